"""Twin process groups for the backward pass of the pipeline's forward-backward overlap.

Under DualPipe's overlap the executor runs one microbatch's forward and another's backward at
once, in two threads (csrc/runtime/executor.h). Ranks match a group's collectives by their
order, so a group both passes talk on gets a twin (same ranks, another communicator): torchpp's
ops issue their collectives on the twin while their thread runs a backward pass
(csrc/ops/pass_groups.h), and Python code that issues collectives from backward hooks asks
``pass_group`` which group to use.
"""
from __future__ import annotations

from typing import Dict

import torch.distributed as dist

from torchpp import _C
from torchpp.parallel.groups import ParallelState
from torchpp.parallel.object_collectives import all_gather_objects

# The data-parallel and expert groups: what a pipeline stage's compute talks on under ep (the
# experts' all-to-all, the load-balancing statistics, the gradient reducers' hooks).
TWINNED = ("ep", "dp", "dp_cp", "expert_dp")


def backward_twins(state: ParallelState) -> Dict[str, dist.ProcessGroup]:
    """Creates (once per state) and registers the backward twin of each of ``state``'s groups in
    ``TWINNED`` with more than one rank; returns {group_name: twin}. Collective: every rank
    calls it."""
    made = getattr(state, "_backward_twins", None)
    if made is not None:
        return made
    made = {}
    for kind in TWINNED:
        group = state.groups().get(kind)
        if group is None or group.group_name in made:
            continue
        # Every rank learns every group of this kind, so all create the twins in one order.
        everyone = all_gather_objects(dist.get_process_group_ranks(group))
        if max(len(ranks) for ranks in everyone) == 1:
            continue
        enumeration = sorted({tuple(ranks) for ranks in everyone})
        twin, _ = dist.new_subgroups_by_enumeration([list(ranks) for ranks in enumeration])
        state.owned_groups.append(twin)  # destroy_parallel frees it
        _C.set_backward_group(group.group_name, twin.group_name)
        made[group.group_name] = twin
    object.__setattr__(state, "_backward_twins", made)
    return made


def pass_group(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """The group a collective issued now on ``group`` goes to: its backward twin while this
    thread runs the backward of an overlapped pipeline pair, else ``group`` itself."""
    name = _C.group_for_current_pass(group.group_name)
    if name == group.group_name:
        return group
    return dist.distributed_c10d._resolve_process_group(name)
