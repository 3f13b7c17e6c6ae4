"""PipelineStage: one model stage placed on this rank (mirrors torch.distributed.pipelining)."""
from __future__ import annotations

from typing import Callable, List, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn

from torchpp import ops
from torchpp.pipeline.stage_chunks import StageChunks


def _examples(stage_index: int, name: str, value, allow_none: bool = False) -> Optional[List[Optional[torch.Tensor]]]:
    """A tensor or a tuple of them (entries may be None where ``allow_none``) as a list."""
    if value is None:
        return None
    entries = [value] if isinstance(value, torch.Tensor) else list(value) if isinstance(value, (tuple, list)) else None
    if not entries or not all(isinstance(t, torch.Tensor) or (allow_none and t is None) for t in entries):
        raise TypeError(f"torchpp.PipelineStage {stage_index}: {name} must be a tensor or a tuple of tensors"
                        f"{' (or None)' if allow_none else ''}, got {value!r}")
    return entries


def _check_gradient_examples(stage_index: int, name: str, grads, args_name: str, args) -> None:
    """A gradient travels with its tensor's dtype and shape; an example that says otherwise is wrong."""
    if grads is None or args is None:
        return
    if len(grads) != len(args):
        raise ValueError(f"torchpp.PipelineStage {stage_index}: {name} has {len(grads)} entries but {args_name} "
                         f"has {len(args)}; give one per tensor, None where no gradient travels")
    for k, (grad, arg) in enumerate(zip(grads, args)):
        if grad is not None and (grad.dtype != arg.dtype or grad.shape[1:] != arg.shape[1:]):
            raise ValueError(f"torchpp.PipelineStage {stage_index}: {name}[{k}] is {list(grad.shape)} {grad.dtype} "
                             f"but {args_name}[{k}] is {list(arg.shape)} {arg.dtype}; a gradient has the dtype "
                             f"and shape of its tensor")


class PipelineStage(StageChunks):
    """A stage module and where it sits in the pipeline; torch.distributed.pipelining's
    arguments, in its order, and ``tp_group``. torch's per-microbatch methods
    (``forward_one_chunk``, ``backward_one_chunk``, ...) come from ``StageChunks``.

    Args:
        submodule: the stage's module. The first stage's takes the microbatch (and any further
            arguments of ``step``); every other stage's takes the previous stage's output: one
            tensor, or the tensors of its tuple as positional arguments. A stage returns a
            tensor or a tuple of tensors (at most 8); gradients flow back to the previous
            stage through the floating-point ones, integer ones (ids, masks) travel forward only.
        stage_index: index of this model stage (0-based).
        num_stages: number of model stages.
        device: device of the stage's parameters and messages.
        input_args: optional example of one microbatch's input (a tensor or a tuple of them,
            may be on the meta device); a received input whose count, dtypes or non-batch
            dimensions differ raises PipelineShapeError on every rank, naming both. Shapes
            travel between stages with or without it (in the first step and when they change),
            since a microbatch's batch size depends on the split.
        output_args: the same for what the stage returns (before the loss, on a last stage).
        output_grads, input_grads: examples of the gradients of the outputs and inputs (None
            where none travels). A torchpp gradient always has its tensor's dtype and shape (no
            DTensor layouts), so these only add a check, against output_args and input_args.
        group: the pipeline-parallel ProcessGroup (or its name; None: the default group). torch
            2.11 and 2.12 take it (and dw_builder) right after output_args, having no gradient
            examples: a ProcessGroup given in output_grads' position is read as that call.
        dw_builder: as in torch: a callable returning a runner of deferred weight gradients.
            Under split-backward schedules (zb-*, ZB-V, DualPipe) it is called right after each
            microbatch's I pass (a full autograd backward, in which the stage's own layers may
            hold their weight gradients back) and the runner it returns is called at that
            microbatch's W; after a full backward (B) the runner is called at once. torchpp's
            split-B/W linears need none: they defer by themselves.
        get_mesh: must be None: it serves torch's DTensor messages, which torchpp does not carry
            (tensor parallelism goes through torchpp.tp's layers and plain tensors).
        tp_group: the tensor-parallel group of this stage (scatter/gather P2P uses it).
        split_bw: whether the stage's plain layers run their backward split into I and W, so
            that a zero-bubble schedule's W passes carry their weight gradients: every
            ``nn.Linear`` (subclasses that keep its forward included) and
            ``nn.MultiheadAttention`` inside ``submodule`` gets a subclass of its own class
            running ``torch.ops.torchpp.split_bw_linear`` (``split_modules.split_linears``;
            parameters, state-dict names and ``isinstance`` unchanged). None (default): on
            when the schedule the stage is built into has W passes for it (zb-h1, zb-h2,
            zb-auto, zb-v, interleaved-zb, dualpipe, dualpipe-v), left as it is otherwise;
            True forces it on; False keeps the plain layers (undoing an earlier swap), so
            their whole backward runs in I. Layers with their own forward (``SplitBWLinear``,
            TP layers) decide their split themselves either way.
    """

    def __init__(
        self,
        submodule: nn.Module,
        stage_index: int,
        num_stages: int,
        device: torch.device,
        input_args: Optional[Union[torch.Tensor, Tuple[torch.Tensor, ...]]] = None,
        output_args: Optional[Union[torch.Tensor, Tuple[torch.Tensor, ...]]] = None,
        output_grads: Optional[Union[torch.Tensor, Tuple[Optional[torch.Tensor], ...]]] = None,
        input_grads: Optional[Union[torch.Tensor, Tuple[Optional[torch.Tensor], ...]]] = None,
        group: ops.GroupLike = None,
        dw_builder: Optional[Callable[[], Callable[[], None]]] = None,
        get_mesh=None,
        *,
        tp_group: ops.GroupLike = None,
        split_bw: Optional[bool] = None,
    ):
        if isinstance(output_grads, dist.ProcessGroup):  # torch 2.11/2.12's positions: (..., output_args, group, dw_builder)
            if group is not None or dw_builder is not None:
                raise TypeError(f"torchpp.PipelineStage {stage_index}: a process group in output_grads' position "
                                f"(torch 2.11's positional group) and group= or dw_builder= as well")
            group, dw_builder, output_grads, input_grads = output_grads, input_grads, None, None
        if not 0 <= stage_index < num_stages:
            raise ValueError(f"torchpp.PipelineStage: stage_index {stage_index} outside [0, {num_stages})")
        if get_mesh is not None:
            raise ValueError(f"torchpp.PipelineStage {stage_index}: get_mesh={get_mesh!r} serves DTensor messages, "
                             "which torchpp does not carry; stages exchange plain tensors (use torchpp.tp's "
                             "layers for tensor parallelism)")
        if split_bw is not None and not isinstance(split_bw, bool):
            raise TypeError(f"torchpp.PipelineStage {stage_index}: split_bw must be None, True or False, "
                            f"got {split_bw!r}")
        if dw_builder is not None and not callable(dw_builder):
            raise TypeError(f"torchpp.PipelineStage {stage_index}: dw_builder must be callable, got {dw_builder!r}")
        self.input_tensors = _examples(stage_index, "input_args", input_args)  # input_args as a list
        self.output_tensors = _examples(stage_index, "output_args", output_args)
        _check_gradient_examples(stage_index, "input_grads", _examples(stage_index, "input_grads", input_grads, True),
                                 "input_args", self.input_tensors)
        _check_gradient_examples(stage_index, "output_grads",
                                 _examples(stage_index, "output_grads", output_grads, True), "output_args",
                                 self.output_tensors)
        self.submod = submodule
        # What runs the stage: the module, or for a traced stage the chain around it (tracing.py).
        self._forward_fn: Callable = submodule
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.device = torch.device(device)
        self.group = ops.group_of(group)
        self.group_rank = dist.get_rank(self.group)
        self.group_size = self.group.size()
        self.input_args = input_args
        self.output_args = output_args
        self.dw_builder = dw_builder
        self.tp_group = ops.group_of(tp_group) if tp_group is not None else None
        self.split_bw = split_bw
        # Names of the submodules swapped onto the split op, set when a schedule is built.
        self.split_bw_modules: List[str] = []
        # Stage index -> pipeline rank, as torch's stages carry it (set by the schedule).
        self.stage_index_to_group_rank: dict = {}
        self._init_chunk_state()

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def __repr__(self) -> str:
        return f"PipelineStage(stage_index={self.stage_index}, num_stages={self.num_stages}, rank={self.group_rank})"


# torch's name for the stage base class (isinstance checks, type hints).
_PipelineStageBase = PipelineStage
