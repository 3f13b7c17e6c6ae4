"""Whether a pipeline runs DualPipe's forward-backward overlap, and the groups it needs.

DualPipe pairs one microbatch's forward with another's backward so that the all-to-all of one
(expert parallelism's dispatch and combine) waits while the other computes. torchpp's executor
runs such pairs in two threads (csrc/runtime/executor.h); the backward's collectives go to twin
groups (torchpp.parallel.backward_groups). What the two threads may not share decides where it
is offered: tensor and context parallelism talk on groups whose collectives are issued by
hooks and channels outside torchpp's ops, ZeRO-2/3 by hooks, and accelerators run backward on
the autograd engine's own threads.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from torchpp.parallel.groups import ParallelState

OVERLAPPED_SCHEDULES = ("dualpipe", "dualpipe-v")


def _obstacles(state: ParallelState, zero: int) -> List[str]:
    found = []
    if state.pp == 1:
        found.append("pp=1 (no pipeline schedule)")
    if torch.device(state.device).type != "cpu":
        found.append(f"device {state.device} (CPU only)")
    if state.tp > 1:
        found.append(f"tp={state.tp}")
    if state.cp > 1:
        found.append(f"cp={state.cp}")
    if zero >= 2:
        found.append(f"zero={zero}")
    return found


def forward_backward_overlap(state: ParallelState, schedule: str, requested: Optional[bool],
                             zero: int) -> Tuple[bool, List[dist.ProcessGroup]]:
    """(whether to overlap, the groups a failing step must break besides the pipeline's).

    ``requested``: None turns it on for DualPipe schedules with ep > 1 where nothing stands in
    the way; True insists (a ValueError names what stands in the way); False turns it off."""
    if requested is not None and not isinstance(requested, bool):
        raise TypeError(f"torchpp.parallelize: overlap_forward_backward must be None, True or False, got {requested!r}")
    obstacles = _obstacles(state, zero)
    if requested and obstacles:
        raise ValueError(f"torchpp.parallelize: overlap_forward_backward=True is not offered with "
                         f"{', '.join(obstacles)}: the forward and backward threads would share groups whose "
                         f"collectives torchpp cannot route to per-pass twins there")
    on = requested if requested is not None else (
        not obstacles and state.ep > 1 and str(schedule).lower() in OVERLAPPED_SCHEDULES)
    if not on:
        return False, []
    from torchpp.parallel.backward_groups import backward_twins

    twins = backward_twins(state)
    groups = [g for g in state.groups().values() if g is not None and g.group_name in twins]
    return True, groups + list(twins.values())
