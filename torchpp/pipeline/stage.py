"""PipelineStage: one model stage placed on this rank (mirrors torch.distributed.pipelining)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from torchpp import ops


class PipelineStage:
    """A stage module and where it sits in the pipeline.

    Args:
        submodule: the stage's module; it takes one tensor (the previous stage's output, or
            the microbatch input on the first stage) and returns one tensor.
        stage_index: index of this model stage (0-based).
        num_stages: number of model stages.
        device: device of the stage's parameters and messages.
        group: the pipeline-parallel ProcessGroup (or its name; None: the default group).
        input_args: optional example of one microbatch's input (a tensor, may be on the meta
            device); a received input whose dtype or non-batch dimensions differ raises
            PipelineShapeError. Without it shapes are exchanged between stages.
        tp_group: the tensor-parallel group of this stage (scatter/gather P2P uses it).
    """

    def __init__(
        self,
        submodule: nn.Module,
        stage_index: int,
        num_stages: int,
        device: torch.device,
        group: ops.GroupLike = None,
        input_args: Optional[torch.Tensor] = None,
        tp_group: ops.GroupLike = None,
    ):
        if not 0 <= stage_index < num_stages:
            raise ValueError(f"torchpp.PipelineStage: stage_index {stage_index} outside [0, {num_stages})")
        if input_args is not None and not isinstance(input_args, torch.Tensor):
            raise TypeError("torchpp.PipelineStage: input_args must be one tensor")
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
