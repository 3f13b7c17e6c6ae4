"""pipeline(): torch.distributed.pipelining's tracing frontend, with stages that torchpp runs.

torch's own tracer (torch.export) traces and splits the model, by ``split_spec`` or
``pipe_split()`` markers, as in torch. A torch ``Pipe`` may send a value from a stage to any
later one (a skip connection, a model input a late layer reads, an output taken early), while
torchpp's messages go from each stage to the next. So each stage module is wrapped in a
``ChainedStage`` that also passes on, unchanged, what later stages need: the same values
reach the same submodules, through a chain.

    from torchpp.pipeline import pipeline, SplitPoint, Schedule1F1B   # was: torch.distributed.pipelining
    pipe = pipeline(model, mb_args=(x_mb,), split_spec={"layers.4": SplitPoint.BEGINNING})
    stage = pipe.build_stage(rank, device, group=pp_group)
"""
from __future__ import annotations

import operator
from typing import Any, Dict, List, Optional

import torch
from torch import fx, nn
from torch.distributed import pipelining as torch_pipelining
from torch.distributed.pipelining import SplitPoint, pipe_split

from torchpp import ops
from torchpp.pipeline.stage import PipelineStage

__all__ = ["ChainedStage", "Pipe", "SplitPoint", "build_stage", "pipe_split", "pipeline"]


class ChainedStage:
    """Runs a traced stage module as a link of the chain: takes everything its stage and later
    ones need from earlier stages (or the step's inputs), returns what the stages after it need
    (the model's output on the last stage). Values are keyed by the split graph's node names.
    Not a module: the stage's parameters stay the traced module's, under the model's names."""

    def __init__(self, module: nn.Module, receives: List[str], arguments: List[str], produces: Dict[str, Optional[int]],
                 returns: List[str]):
        self.module = module
        self.receives = receives  # names of the positional inputs (the step's inputs on stage 0)
        self.arguments = arguments  # names the module takes, in order
        self.produces = produces  # name -> index into the module's output tuple (None: the output itself)
        self.returns = returns  # one value is returned as itself (a stage module's own output may be a tuple)

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def forward(self, *args, **kwargs):
        if len(args) > len(self.receives):
            raise TypeError(f"torchpp traced stage: {len(args)} inputs, expected at most {len(self.receives)} "
                            f"({self.receives})")
        values = dict(zip(self.receives, args))
        values.update(kwargs)  # the first stage's keyword inputs, by the model's argument names
        missing = [name for name in self.arguments if name not in values]
        if missing:
            raise TypeError(f"torchpp traced stage: inputs {missing} not given")
        out = self.module(*[values[name] for name in self.arguments])
        for name, index in self.produces.items():
            values[name] = out if index is None else out[index]
        result = tuple(values[name] for name in self.returns)
        return result[0] if len(result) == 1 else result


def _stage_calls(graph: fx.Graph) -> List[fx.Node]:
    calls = [n for n in graph.nodes if n.op == "call_module" and str(n.target).startswith("submod_")]
    return sorted(calls, key=lambda n: int(str(n.target).rsplit("_", 1)[1]))


def chain(graph: fx.Graph, stage_index: int, module: nn.Module) -> ChainedStage:
    """``module`` (stage ``stage_index`` of the split ``graph``) as a link of the chain."""
    calls = _stage_calls(graph)
    if not 0 <= stage_index < len(calls):
        raise ValueError(f"torchpp pipeline: stage {stage_index} outside the pipe's {len(calls)} stages")
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    producer = {n.name: -1 for n in placeholders}  # the stage computing each value; -1: a step input
    produces: List[Dict[str, Optional[int]]] = [{} for _ in calls]
    for k, call in enumerate(calls):
        if call.kwargs:
            raise ValueError(f"torchpp pipeline: stage {k} of the traced pipe takes keyword inputs {list(call.kwargs)}")
        for user in call.users:
            if user.op == "call_function" and user.target is operator.getitem:
                produces[k][user.name] = user.args[1]
            else:
                produces[k][call.name] = None
        for name in produces[k]:
            producer[name] = k
    output = next(n for n in graph.nodes if n.op == "output").args[0]
    outputs = list(output) if isinstance(output, (tuple, list)) else [output]
    if not all(isinstance(v, fx.Node) and v.name in producer for v in outputs):
        raise ValueError(f"torchpp pipeline: the traced model returns {output!r}; a stage returns tensors only")

    def needed_after(k: int) -> List[str]:
        """Values computed by stage k or earlier that stages after k (or the output) read."""
        later = [a.name for call in calls[k + 1:] for a in call.args if isinstance(a, fx.Node) and a.name in producer]
        later += [v.name for v in outputs]  # (a later stage's other inputs fail that stage's own chain())
        return list(dict.fromkeys(name for name in later if producer[name] <= k))

    call = calls[stage_index]
    bad = [a for a in call.args if not isinstance(a, fx.Node) or a.name not in producer]
    if bad:
        raise ValueError(f"torchpp pipeline: stage {stage_index} of the traced pipe takes non-tensor inputs {bad}")
    receives = [n.name for n in placeholders] if stage_index == 0 else needed_after(stage_index - 1)
    last = stage_index == len(calls) - 1
    returns = [v.name for v in outputs] if last else needed_after(stage_index)
    return ChainedStage(module, receives, [a.name for a in call.args], produces[stage_index], returns)


class Pipe(nn.Module):
    """torch's traced ``Pipe`` whose stages torchpp runs: an ``nn.Module`` holding the split
    graph (``split_gm``, so ``.to()``, ``parameters()`` and ``state_dict()`` work on every
    stage's parameters); calling it runs the stages one after the other in this process and
    returns the model's outputs as a tuple, as torch's does. ``build_stage`` returns a torchpp
    ``PipelineStage`` of a stage's module, chained (see ``ChainedStage``)."""

    def __init__(self, traced: "torch_pipelining.Pipe"):
        super().__init__()
        if traced.has_loss_and_backward:
            raise ValueError("torchpp pipeline: a traced model that computes its loss and backward is not supported; "
                             "pass loss_fn to the schedule instead")
        self.split_gm: fx.GraphModule = traced.split_gm
        self.num_stages: int = traced.num_stages
        self.has_loss_and_backward = False
        self.replicated_params = traced.replicated_params
        object.__setattr__(self, "_info", traced.info())  # plain attribute: not a submodule

    def forward(self, *args, **kwargs):
        chain_links = [chain(self.split_gm.graph, k, self.get_stage_module(k)) for k in range(self.num_stages)]
        values = chain_links[0](*args, **kwargs)
        for link in chain_links[1:]:
            values = link(*(values if isinstance(values, tuple) else (values,)))
        return values if isinstance(values, tuple) else (values,)

    def get_stage_module(self, stage_idx: int) -> nn.Module:
        """The traced module of stage ``stage_idx`` (its parameters are the model's, by its names)."""
        if not 0 <= stage_idx < self.num_stages:
            raise ValueError(f"torchpp pipeline: stage {stage_idx} outside the pipe's {self.num_stages} stages")
        return self.split_gm.get_submodule(str(_stage_calls(self.split_gm.graph)[stage_idx].target))

    def info(self):
        """torch's ``PipeInfo`` of the split graph (``build_stage``'s ``pipe_info``)."""
        return self._info

    def build_stage(self, stage_index: int, device: torch.device, group: ops.GroupLike = None, *,
                    tp_group: ops.GroupLike = None) -> PipelineStage:
        return build_stage(self.get_stage_module(stage_index), stage_index, self.info(), device, group,
                           tp_group=tp_group)


def pipeline(module: nn.Module, mb_args: tuple, mb_kwargs: Optional[Dict[str, Any]] = None,
             split_spec: Optional[Dict[str, SplitPoint]] = None, split_policy=None) -> Pipe:
    """Traces and splits ``module`` with torch's tracer (same arguments as
    ``torch.distributed.pipelining.pipeline``: one microbatch's example inputs, and split
    points by module name or ``pipe_split()`` calls in the forward)."""
    return Pipe(torch_pipelining.pipeline(module, mb_args, mb_kwargs, split_spec, split_policy))


def build_stage(stage_module: nn.Module, stage_index: int, pipe_info, device: torch.device,
                group: ops.GroupLike = None, *, tp_group: ops.GroupLike = None) -> PipelineStage:
    """A torchpp PipelineStage of a traced stage module (torch's ``build_stage``, same arguments)."""
    if isinstance(stage_module, fx.GraphModule):
        _place_graph_ops(stage_module, torch.device(device))
    stage = PipelineStage(stage_module, stage_index, pipe_info.num_stages, device, group=group, tp_group=tp_group)
    stage._forward_fn = chain(pipe_info.graph, stage_index, stage_module)
    return stage


def _place_graph_ops(module: fx.GraphModule, device: torch.device) -> None:
    """Tracing burns the tracing device into ops that create tensors (torch.zeros(..., device=));
    point them at the stage's device, as torch's build_stage does."""
    changed = False
    for node in module.graph.nodes:
        if node.op == "call_function" and isinstance(node.kwargs.get("device"), torch.device):
            if node.kwargs["device"] != device:
                node.update_kwarg("device", device)
                changed = True
    for child in module.children():
        if isinstance(child, fx.GraphModule):
            _place_graph_ops(child, device)
    if changed:
        module.recompile()
