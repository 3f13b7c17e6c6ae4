"""PipelineStage: one model stage placed on this rank (mirrors torch.distributed.pipelining)."""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn

from torchpp import ops


class PipelineStage:
    """A stage module and where it sits in the pipeline.

    Args:
        submodule: the stage's module. The first stage's takes the microbatch (and any further
            arguments of ``step``); every other stage's takes the previous stage's output: one
            tensor, or the tensors of its tuple as positional arguments. A stage returns a
            tensor or a tuple of tensors (at most 8); gradients flow back to the previous
            stage through the floating-point ones, integer ones (ids, masks) travel forward only.
        stage_index: index of this model stage (0-based).
        num_stages: number of model stages.
        device: device of the stage's parameters and messages.
        group: the pipeline-parallel ProcessGroup (or its name; None: the default group).
        input_args: optional example of one microbatch's input (a tensor or a tuple of them,
            may be on the meta device); a received input whose count, dtypes or non-batch
            dimensions differ raises PipelineShapeError, naming both. Shapes travel between
            stages with or without it (in the first step and when they change), since a
            microbatch's batch size depends on the split.
        tp_group: the tensor-parallel group of this stage (scatter/gather P2P uses it).
    """

    def __init__(
        self,
        submodule: nn.Module,
        stage_index: int,
        num_stages: int,
        device: torch.device,
        group: ops.GroupLike = None,
        input_args: Optional[Union[torch.Tensor, Tuple[torch.Tensor, ...]]] = None,
        tp_group: ops.GroupLike = None,
    ):
        if not 0 <= stage_index < num_stages:
            raise ValueError(f"torchpp.PipelineStage: stage_index {stage_index} outside [0, {num_stages})")
        self.input_tensors = None  # input_args as a list
        if input_args is not None:
            tensors = (input_args,) if isinstance(input_args, torch.Tensor) else tuple(input_args)
            if not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
                raise TypeError("torchpp.PipelineStage: input_args must be a tensor or a tuple of tensors, got "
                                f"{input_args!r}")
            self.input_tensors = list(tensors)
        self.submod = submodule
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.device = torch.device(device)
        self.group = ops.group_of(group)
        self.group_rank = dist.get_rank(self.group)
        self.group_size = self.group.size()
        self.input_args = input_args
        self.tp_group = ops.group_of(tp_group) if tp_group is not None else None

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def __repr__(self) -> str:
        return f"PipelineStage(stage_index={self.stage_index}, num_stages={self.num_stages}, rank={self.group_rank})"
