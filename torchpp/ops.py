"""Python entry points to torch.ops.torchpp's tensor/sequence-parallel mappings.

The schemas, kernels and autograd live in C++ (csrc/ops). These wrappers only turn a
``ProcessGroup`` (or ``None`` for the default group, or a group name) into the
``group_name`` and ``group_size`` the ops take.

| op                           | forward                    | backward                 |
|------------------------------|----------------------------|--------------------------|
| copy_to_tp_region (f)        | identity                   | all-reduce               |
| reduce_from_tp_region (g)    | all-reduce                 | identity                 |
| scatter_to_tp_region         | keep own slice along dim   | all-gather along dim     |
| gather_from_tp_region        | all-gather along dim       | keep own slice           |
| scatter_to_sp_region         | keep own sequence slice    | all-gather               |
| gather_from_sp_region (g)    | all-gather along sequence  | reduce-scatter           |
| reduce_scatter_to_sp_region  | reduce-scatter along seq.  | all-gather               |
| moe_dispatch                 | routed rows to experts     | rows back, summed/token  |
| moe_combine                  | rows back, weighted sum    | rows to experts; weights |

Over gloo, every collective is preceded by a check that all ranks pass the same shape and
dtype (see ``set_collective_checks``).
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Union

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from torchpp import _C  # loading the extension registers torch.ops.torchpp

GroupLike = Optional[Union[dist.ProcessGroup, str]]

__all__ = [
    "GroupLike",
    "group_name_of",
    "group_of",
    "copy_to_tp_region",
    "reduce_from_tp_region",
    "scatter_to_tp_region",
    "gather_from_tp_region",
    "scatter_to_sp_region",
    "gather_from_sp_region",
    "reduce_scatter_to_sp_region",
    "MoeRouting",
    "moe_route",
    "moe_dispatch",
    "moe_combine",
    "collective_checks",
    "set_collective_checks",
]


def group_of(group: GroupLike) -> dist.ProcessGroup:
    """Returns the ProcessGroup for a group, a group name, or None (the default group)."""
    if group is None:
        if not dist.is_initialized():
            raise RuntimeError("torchpp: torch.distributed is not initialized and no group was given")
        return dist.group.WORLD
    if isinstance(group, str):
        try:
            return _resolve_process_group(group)
        except Exception as error:
            raise ValueError(f"torchpp: unknown process group name {group!r}") from error
    return group


def group_name_of(group: GroupLike) -> str:
    """Returns the name c10d registered the group under (what torch.ops.torchpp takes)."""
    if isinstance(group, str):
        return group
    return group_of(group).group_name


def copy_to_tp_region(input: torch.Tensor, group: GroupLike = None) -> torch.Tensor:
    """Megatron's f: identity forward, all-reduce of the gradient over ``group`` backward."""
    return torch.ops.torchpp.copy_to_tp_region(input, group_name_of(group))


def reduce_from_tp_region(input: torch.Tensor, group: GroupLike = None) -> torch.Tensor:
    """Megatron's g: all-reduce (sum) over ``group`` forward, identity backward."""
    return torch.ops.torchpp.reduce_from_tp_region(input, group_name_of(group))


def _sized(op, input: torch.Tensor, group: GroupLike, dim: int) -> torch.Tensor:
    resolved = group_of(group)
    return op(input, resolved.group_name, resolved.size(), dim)


def scatter_to_tp_region(input: torch.Tensor, group: GroupLike = None, dim: int = -1) -> torch.Tensor:
    """Keeps this rank's slice of ``dim`` forward; all-gathers the gradient backward."""
    return _sized(torch.ops.torchpp.scatter_to_tp_region, input, group, dim)


def gather_from_tp_region(input: torch.Tensor, group: GroupLike = None, dim: int = -1) -> torch.Tensor:
    """All-gathers along ``dim`` forward; keeps this rank's slice of the gradient backward."""
    return _sized(torch.ops.torchpp.gather_from_tp_region, input, group, dim)


def scatter_to_sp_region(input: torch.Tensor, group: GroupLike = None, dim: int = 0) -> torch.Tensor:
    """Keeps this rank's sequence slice forward; all-gathers the gradient backward."""
    return _sized(torch.ops.torchpp.scatter_to_sp_region, input, group, dim)


def gather_from_sp_region(input: torch.Tensor, group: GroupLike = None, dim: int = 0) -> torch.Tensor:
    """Sequence-parallel g: all-gathers the sequence forward; reduce-scatters the gradient backward."""
    return _sized(torch.ops.torchpp.gather_from_sp_region, input, group, dim)


def reduce_scatter_to_sp_region(input: torch.Tensor, group: GroupLike = None, dim: int = 0) -> torch.Tensor:
    """Sequence-parallel g-bar: reduce-scatters along the sequence forward; all-gathers backward."""
    return _sized(torch.ops.torchpp.reduce_scatter_to_sp_region, input, group, dim)


# The expert ops' output sizes depend on the routing (the data), which fake tensors cannot know:
# compiled code breaks its graph around them and runs them eagerly.
_eager_only = torch.compiler.disable


class MoeRouting(NamedTuple):
    """Where one rank's routed (token, slot) pairs go (``moe_route``); ``dropped``: pairs over capacity."""

    order: torch.Tensor
    send_counts: torch.Tensor
    recv_counts: torch.Tensor
    dropped: torch.Tensor
    top_k: int
    num_tokens: int
    group_name: str
    group_size: int

    @property
    def tokens_per_local_expert(self) -> torch.Tensor:
        """Rows each of this rank's experts receives (moe_dispatch's blocks, in expert order)."""
        return self.recv_counts.sum(0)


@_eager_only
def moe_route(expert_index: torch.Tensor, num_experts: int, group: GroupLike = None,
              capacity_factor: Optional[float] = None) -> MoeRouting:
    """Plans the all-to-all of routed tokens: ``num_experts`` split evenly over ``group`` (rank r
    holds experts [r E/g, (r+1) E/g)); the per-expert counts are exchanged over the group.

    Args:
        expert_index: [tokens, top_k] expert of each (token, slot) pair.
        num_experts: experts in all (a multiple of the group size).
        group: the expert-parallel group (a ProcessGroup or its name).
        capacity_factor: None (dropless) or the factor of Switch Transformer's capacity: each
            expert keeps at most ceil(factor * tokens * top_k / num_experts) of this rank's pairs
            (earlier tokens first); the rest are dropped, counted in ``dropped``.
    """
    resolved = group_of(group)
    order, send, recv, dropped = torch.ops.torchpp.moe_route(expert_index, num_experts, resolved.group_name,
                                                             resolved.size(), capacity_factor)
    return MoeRouting(order, send, recv, dropped, expert_index.size(1), expert_index.size(0), resolved.group_name,
                      resolved.size())


@_eager_only
def moe_dispatch(hidden: torch.Tensor, routing: MoeRouting) -> torch.Tensor:
    """Rows of ``hidden`` [tokens, h] for every routed pair, on the ranks of their experts:
    [routing.tokens_per_local_expert.sum(), h], one block per local expert."""
    return torch.ops.torchpp.moe_dispatch(hidden, routing.order, routing.send_counts, routing.recv_counts,
                                          routing.top_k, routing.group_name, routing.group_size)


@_eager_only
def moe_combine(expert_output: torch.Tensor, weights: torch.Tensor, routing: MoeRouting) -> torch.Tensor:
    """The experts' output rows back on their tokens' ranks, weighted by ``weights`` [tokens,
    top_k] (the router's probabilities) and summed per token: [tokens, h]."""
    return torch.ops.torchpp.moe_combine(expert_output, weights, routing.order, routing.send_counts,
                                         routing.recv_counts, routing.num_tokens, routing.group_name,
                                         routing.group_size)


def collective_checks() -> bool:
    """Whether the ops check shapes across ranks before each collective over gloo."""
    return _C.collective_checks()


def set_collective_checks(enabled: bool) -> None:
    """Turns the check before each collective over gloo on (default) or off; the environment
    variable TORCHPP_COLLECTIVE_CHECKS=0 starts with it off.

    Ranks that pass tensors of different sizes to one gloo collective abort the whole process
    (SIGABRT inside gloo). The check, one all-reduce of two int64 ahead of the collective,
    makes every rank raise a RuntimeError naming each rank's shape instead, and leaves the
    group usable. Groups whose backend is not gloo (NCCL) are not checked.

    Args:
        enabled: check (True) or not (False).
    """
    _C.set_collective_checks(bool(enabled))
