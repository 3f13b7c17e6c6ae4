"""Where a transformers model's modules run relative to its stack of layers, from one traced forward.

The registration order (``plans.layout_around``) is a guess that transformers usually keeps:
modules registered before the stack run before it. Not always: a final norm registered before
the layers (T5Gemma's encoder), or per-layer embeddings registered after them but run before
(Gemma 3n, Phi-4 multimodal). A forward on a few tokens, with hooks, tells for each module
outside the stack that holds parameters:

- whether it first runs before the first layer (first pipeline stage) or after the last (last stage);
- whether it is *shared*: its parameters reach, through autograd, an input of a layer other than
  the hidden states (a rotary table with a learned scale, per-layer token embeddings), or its
  outputs include integers that steer the forward (BLT's patcher: its patch lengths). Every
  stage needs such a module: it is kept on every pipeline rank, and its gradients are summed
  over the pipeline (``torchpp.models.passes.schedule``).

A model that cannot run here (built on the meta device, where a data-dependent step fails)
keeps its registration order.
"""
from __future__ import annotations

import itertools
from collections import UserDict
from typing import Dict, List, Set, Tuple

import torch
from torch import nn

from torchpp.models.autograd_walk import tensors_in, walk_back
from torchpp.models.carried_check import CarriedAcrossLayers, other_inputs
from torchpp.models.module_state import AFTER_STACK, StateOnModules
from torchpp.models.stages import PipelineLayout, get_submodule
from torchpp.models.traced_forward import traced_forward, untracked_layers_error



def traced_layout(model: nn.Module, layout: PipelineLayout) -> PipelineLayout:
    """``layout`` with its modules ordered by a traced forward and the shared ones set apart.

    Args:
        model: the unwrapped transformers model (run once on a few tokens: ``traced_forward``; unchanged).
        layout: the registration-order layout around the stack.

    Raises:
        PlanError: the model runs its layers without autograd, inside a function of its own that
            computes their gradients itself (Reformer's reversible layers, recomputed in its
            backward): a pipeline stage needs each layer's own autograd graph.
    """
    candidates = list(layout.before) + list(layout.after)
    try:
        first_call, start, end, reached, extras, state, handed, carried, untracked, writes = _trace(
            model, layout, candidates)
    except Exception:  # noqa: BLE001 - a model that cannot run here keeps the registration order
        return layout
    if untracked:
        raise untracked_layers_error(model, layout.layers, untracked, "a pipeline stage needs each layer's own "
                                     "autograd graph; use pp=1")
    # Run before the stack's end (or inside it) and feeding the layers: every stage needs it. (A tied
    # head after the stack shares a parameter with a shared embedding but runs on the last stage.)
    shared = [p for p in candidates if first_call.get(p, end + 1) <= end
              and (_holds_any(get_submodule(model, p), reached) or first_call[p] >= start or p in handed)]
    rest = [p for p in candidates if p not in shared]
    registered_before = set(layout.before)
    before = [p for p in rest if first_call.get(p, end + 1) < start or (p not in first_call and p in registered_before)]
    after = [p for p in rest if p not in before]
    by_call = lambda p: first_call.get(p, float("inf"))  # noqa: E731 - modules that never ran keep their place
    reads_inside = carried.reads_inside()
    for reader, writers in writes.reads_inside().items():  # module state outside autograd (integers, masks)
        reads_inside[reader] = tuple(sorted(set(reads_inside.get(reader, ())) | set(writers)))
    if writes.read_after_stack():
        reads_inside[AFTER_STACK] = writes.read_after_stack()
    return PipelineLayout(layout.layers, sorted(before, key=by_call), sorted(after, key=by_call), shared, extras,
                          state, carried.reads(after), reads_inside)


def _holds_any(module: nn.Module, reached: Set[int]) -> bool:
    return any(id(param) in reached for param in module.parameters())


def _trace(model: nn.Module, layout: PipelineLayout, candidates: List[str]):
    """(first call index of each candidate, index at the first layer's start, index at the last
    layer's end, ids of the parameters reaching the layers' other inputs, the layers' extra
    outputs: ``PipelineLayout.extras``, ..., the module state layers wrote and read)."""
    counter = itertools.count()
    first_call: Dict[str, int] = {}
    side: List[torch.Tensor] = []
    exits: Set[object] = set()
    marks: Dict[str, int] = {}
    extras: Dict[int, Tuple[bool, ...]] = {}
    state: Dict[int, tuple] = {}
    layers = list(get_submodule(model, layout.layers))
    hooks = []
    carried = CarriedAcrossLayers()
    writes = StateOnModules()

    def on_call(path):
        def hook(module, args):
            first_call.setdefault(path, next(counter))
        return hook

    def on_layer(index):
        def hook(module, args, kwargs):
            marks.setdefault("start", next(counter))
            if not torch.is_grad_enabled() and index not in untracked:
                untracked.append(index)
            others = list(args[1:]) + [v for k, v in kwargs.items() if k != "hidden_states"]
            side.extend(tensors_in(others))
            carried.side.setdefault(index, other_inputs(others))
            carried.enter(index, args, kwargs)
            writes.enter(index)
        return hook

    def on_layer_exit(index):
        def hook(module, args, kwargs, output):
            writes.leave()
            marks["end"] = next(counter)
            carried.leave(index, output)
            exits.update(t.grad_fn for t in tensors_in([output]) if t.grad_fn is not None)
            hidden = output[0] if isinstance(output, (tuple, list)) else output
            carried.outputs.setdefault(index, getattr(hidden, "grad_fn", None))
            if isinstance(output, (tuple, list)):  # (hidden, what the next layer reads), or (hidden,)
                extras[index] = tuple(isinstance(o, torch.Tensor) for o in output[1:])
                carried.handed_on.update(t.grad_fn for t in tensors_in(list(output[1:])) if t.grad_fn is not None)
            for name, value in kwargs.items():  # a mapping the layers fill for later layers (shared k/v)
                if isinstance(value, (dict, UserDict)) and value and all(
                        isinstance(v, tuple) and all(isinstance(t, torch.Tensor) for t in v) for v in value.values()):
                    state[index] = (name, tuple((key, len(v)) for key, v in value.items()))
        return hook

    untracked: List[int] = []  # layers run with autograd off while the trace has it on

    outputs: Dict[str, Set[int]] = {}
    steering: Set[str] = set()  # modules returning integers (BLT's patcher: patch lengths)

    def on_input(path):
        def hook(module, args, kwargs):
            carried.module_inputs.setdefault(path, tensors_in([list(args), kwargs]))
        return hook

    def on_output(path):
        def hook(module, args, output):
            tensors = tensors_in([output])
            outputs.setdefault(path, set()).update(t.untyped_storage().data_ptr() for t in tensors)
            if any(not t.is_floating_point() for t in tensors):
                steering.add(path)
        return hook

    for path in candidates:  # a container (a ModuleList of projections) runs when its first member does
        hooks.extend(module.register_forward_pre_hook(on_call(path)) for module in get_submodule(model, path).modules())
        hooks.append(get_submodule(model, path).register_forward_hook(on_output(path)))
        hooks.append(get_submodule(model, path).register_forward_pre_hook(on_input(path), with_kwargs=True))
    for index, layer in enumerate(layers):
        hooks.append(layer.register_forward_pre_hook(on_layer(index), with_kwargs=True))
        hooks.append(layer.register_forward_hook(on_layer_exit(index), with_kwargs=True))
    try:
        with writes.watching():
            traced_forward(model)
    finally:
        for hook in hooks:
            hook.remove()
    # Modules whose output itself (or a view of it) reaches a layer: a table without gradients (sinusoidal positions).
    side_storage = {t.untyped_storage().data_ptr() for t in side}
    # ... or whose integer outputs steer the rest of the forward: zeros in their place would change it.
    handed = {path for path, ptrs in outputs.items() if ptrs & side_storage} | steering
    return (first_call, marks["start"], marks["end"], walk_back(side, blocked=exits).params, extras, state, handed,
            carried, untracked, writes)
