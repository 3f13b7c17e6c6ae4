"""What every TP style shares: the plan error, the context of one model's TP group, sharding a
parameter in place (the same Parameter object, so ties hold) and the gradient sums of parameters
applied to rank-local data."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

import torch
import torch.distributed as dist
from torch import nn

from torchpp.tensor_parallel.layouts import FusedQKV, HeadCopies, Layout, Packed, Replicated
from torchpp.tensor_parallel.utils import mark_tensor_parallel, through_slot


class PlanError(ValueError):
    """A plan that cannot be applied to the model: the message names the entry and the value."""


class GroupContext:
    """This rank's size and rank in ``self.group``: what a style's context (TP, EP) needs of it."""

    group: dist.ProcessGroup

    @property
    def size(self) -> int:
        return self.group.size()

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)


@dataclass
class TPContext(GroupContext):
    """What every style applied to one model shares."""

    group: dist.ProcessGroup
    sequence_parallel: bool = False
    split_bw: bool = False
    num_heads: Optional[int] = None  # query heads, to check head-aligned splits
    num_kv_heads: Optional[int] = None
    head_dim: Optional[int] = None
    hooks: List[object] = field(default_factory=list)


def shard_parameter(param: nn.Parameter, layout: Layout, ctx: TPContext, name: str) -> None:
    """Replaces ``param``'s data by this rank's shard under ``layout`` (the same Parameter object,
    so a tie to another module holds) and records the layout."""
    if getattr(param, "tp_layout", None) is not None:
        if repr(param.tp_layout) != repr(layout):  # a tied parameter reached twice must agree
            raise PlanError(f"torchpp plan: {name} is sharded twice, as {param.tp_layout!r} and {layout!r}")
        return
    try:
        local = layout.shard(param.detach(), ctx.rank, ctx.size)
    except ValueError as error:
        raise PlanError(f"torchpp plan: cannot shard {name} of shape {tuple(param.shape)} over tp={ctx.size}: "
                        f"{error}") from None
    with torch.no_grad():
        param.data = local.clone() if param.is_meta else local.contiguous().clone()
    param.tp_layout = layout
    if layout.dim is not None:
        mark_tensor_parallel(param, partition_dim=layout.dim % param.dim(), group_size=ctx.size)
    if isinstance(layout, HeadCopies):
        param.tp_replicas = layout.replicas
        if ctx.rank % layout.replicas:
            param.shared_duplicate = True  # the norm counts one copy of each head
    if isinstance(layout, (FusedQKV, Packed)) and len(layout.uncounted(ctx.rank, ctx.size)):
        rows = layout.uncounted(ctx.rank, ctx.size)  # copied key/value rows: another rank's copy is counted
        param.tp_uncounted = (layout.dim % param.dim(), rows.start, rows.stop)
    if isinstance(layout, Packed) and layout.copied_rows(ctx.size) is not None:
        # Copied groups (Mamba 2's B and C) read by this rank's heads only: their gradient rows
        # are summed over the group's copies, the rest of the tensor's stay this rank's.
        param.tp_grad_sum = "rows"
        param.tp_grad_rows = (layout.dim % param.dim(), *layout.copied_rows(ctx.size))


def full_shape(param: torch.Tensor, ctx: TPContext) -> torch.Size:
    """The shape of ``param`` before sharding (a tied parameter may have been sharded already)."""
    layout = getattr(param, "tp_layout", None)
    return param.shape if layout is None or layout.dim is None else layout.full_shape(param.shape, ctx.size)


def sum_grads_over_tp(param: nn.Parameter, ctx: TPContext) -> None:
    """Marks ``param`` as replicated but applied to rank-local data (sequence slices, its own
    heads): its gradients arrive partial on each TP rank and ``install_grad_hooks`` sums them
    before they accumulate, so ``.grad`` is complete after every backward."""
    param.tp_grad_sum = getattr(param, "tp_grad_sum", None) or "tp"
    param.tp_layout = getattr(param, "tp_layout", None) or Replicated()


def sum_grads_over_copies(param: nn.Parameter, ctx: TPContext) -> None:
    """Marks a head copied onto ``param.tp_replicas`` consecutive TP ranks: each copy's share of
    the gradient is summed over its copies (``install_grad_hooks``)."""
    param.tp_grad_sum = "copies"


def install_grad_hooks(module: nn.Module, ctx: TPContext) -> None:
    """Registers the gradient sums ``sum_grads_over_tp`` and ``sum_grads_over_copies`` marked, and
    those of copied rows (``shard_parameter`` of a Packed layout with copied groups), after the
    parameters have their final storage (a hook belongs to a tensor's storage)."""
    group, rank, size = ctx.group, ctx.rank, ctx.size

    def all_reduce(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        dist.all_reduce(grad, group=group)
        return grad

    def sum_copies(replicas: int):
        def hook(grad: torch.Tensor) -> torch.Tensor:  # one all-reduce; each rank adds into its head's slot
            return through_slot(grad, rank // replicas, size // replicas, all_reduce)
        return hook

    def sum_copied_rows(dim: int, start: int, stop: int, replicas: int):
        def hook(grad: torch.Tensor) -> torch.Tensor:
            grad = grad.clone()
            rows = grad.narrow(dim, start, stop - start)
            rows.copy_(sum_copies(replicas)(rows))
            return grad
        return hook

    for param in module.parameters():
        kind = getattr(param, "tp_grad_sum", None)
        if kind is None or getattr(param, "_tp_grad_hooked", False):
            continue
        hook = (all_reduce if kind == "tp" else sum_copied_rows(*param.tp_grad_rows) if kind == "rows"
                else sum_copies(param.tp_replicas))
        ctx.hooks.append(param.register_hook(hook))
        param._tp_grad_hooked = True
