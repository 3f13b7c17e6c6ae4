"""Hierarchical context parallelism: all-to-all inside groups of consecutive cp ranks, the ring across.

Megatron's cp_comm_type "a2a+p2p": with a cp group of c = a * c' ranks, the a consecutive ranks of
each all-to-all group (one node's, over NVLink) trade heads for the sequence, and ring attention
runs over the c' ranks at the same place in each group (across nodes). A rank's ring passes c' - 1
key/value blocks instead of c - 1, and a need only divide the heads (not c, as all-to-all alone).
``attention(..., mode="all-to-all+ring", group=hierarchical_groups(a, cp_group))``;
``parallelize(model, cp=c, cp_mode="all-to-all+ring", cp_all_to_all_size=a)``.
"""
from __future__ import annotations

from typing import Tuple

import torch.distributed as dist

from torchpp.ops import GroupLike, group_of
from torchpp.parallel.object_collectives import all_gather_objects

__all__ = ["check_all_to_all_size", "hierarchical_groups"]


def check_all_to_all_size(all_to_all_size, cp: int) -> None:
    if not isinstance(all_to_all_size, int) or all_to_all_size < 1 or cp % all_to_all_size:
        raise ValueError(f"torchpp context parallelism: the all-to-all groups of hierarchical cp cut the cp={cp} "
                         f"ranks into groups of consecutive ranks, so their size must divide {cp}, got "
                         f"all_to_all_size={all_to_all_size!r}")


def hierarchical_groups(all_to_all_size: int, group: GroupLike = None) -> Tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This rank's (all-to-all group, ring group) in the context-parallel ``group``: its ranks cut
    into groups of ``all_to_all_size`` consecutive ones (cp rank = ring rank * a + all-to-all rank),
    and the ranks at the same place in each of them.

    Collective over the world: every rank calls it (each with its own cp group, all with the same
    size), as ``torch.distributed.new_group``. Owned by torchpp's parallel state when there is one
    (``destroy_parallel`` frees them).

    Raises:
        ValueError: when ``all_to_all_size`` does not divide the group's size.
    """
    group = group_of(group)
    # (gathered before any check: a size one rank got wrong raises on every rank, none waits)
    every = all_gather_objects((tuple(dist.get_process_group_ranks(group)), all_to_all_size))
    sizes = {repr(a) for _, a in every}
    if len(sizes) > 1:
        raise ValueError(f"torchpp context parallelism: ranks asked for all-to-all groups of different sizes "
                         f"{sorted(sizes)}; every rank must pass the same all_to_all_size")
    check_all_to_all_size(all_to_all_size, group.size())
    cp_groups = list(dict.fromkeys(ranks for ranks, _ in every))  # each once, in the same order on every rank
    mine = tuple(dist.get_process_group_ranks(group))
    a = all_to_all_size
    found = {}
    for ranks in cp_groups:
        for kind, members in [("all_to_all", ranks[o * a:(o + 1) * a]) for o in range(len(ranks) // a)] \
                + [("ring", ranks[i::a]) for i in range(a)]:
            made = _new_group(list(members))
            if ranks == mine and dist.get_rank() in members:
                found[kind] = made
    inner, ring = found["all_to_all"], found["ring"]
    position = mine.index(dist.get_rank())
    if ring.rank() * a + inner.rank() != position:  # (new_group orders ranks by global rank)
        raise RuntimeError(f"torchpp context parallelism: cp group {list(mine)} is not in increasing rank order; "
                           f"its hierarchical groups would not match its layout")
    return inner, ring


def _new_group(ranks):
    from torchpp.parallel.groups import _STATE, new_layout_group

    return new_layout_group(_STATE, ranks) if _STATE is not None else dist.new_group(ranks)
