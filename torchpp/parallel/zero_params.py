"""ZeRO-3's just-in-time parameter gathers, and the one reading of a ``zero=`` argument.

Each module that owns parameters directly gets a forward pre-hook that gathers the buckets
holding them (a no-op when they are gathered already). Under a pipeline the first microbatch's
forward gathers a stage's buckets and the later microbatches find them gathered: one all-gather
per bucket per step, released when the bucket's gradient is reduce-scattered after its last
backward (or W) pass. Recomputation re-runs the forward inside backward, before that release.
"""
from __future__ import annotations

from typing import List, Union

import torch

ZERO_STAGES = (0, 1, 2, 3)


def zero_stage(zero: Union[bool, int]) -> int:
    """The ZeRO stage named by ``zero``: False -> 0, True -> 1, or the int 0..3 itself."""
    if isinstance(zero, bool):
        return int(zero)
    if isinstance(zero, int) and zero in ZERO_STAGES:
        return zero
    raise ValueError(f"torchpp: zero must be one of {ZERO_STAGES} (or True for 1, False for 0), got {zero!r}")


def gather_before_forward(model: torch.nn.Module, optimizer) -> List[torch.utils.hooks.RemovableHandle]:
    """Registers, on every module of ``model`` that owns parameters, a forward pre-hook that
    gathers those parameters' buckets from ``optimizer`` (a ZeroRedundancyOptimizer built
    with shard_params). Returns the hook handles."""
    handles = []
    for module in model.modules():
        own = [p for p in module.parameters(recurse=False) if p.requires_grad]
        if not own:
            continue

        def gather(_module, _args, own=own):
            optimizer.gather_params_of(own)

        handles.append(module.register_forward_pre_hook(gather))
    return handles
