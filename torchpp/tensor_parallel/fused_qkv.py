"""Fused query/key/value projections under TP (``packed_qkv_colwise``, ``packed_qkv_grouped_colwise``):
each rank keeps its query heads and the key/value heads they read, copies of them where the ranks
outnumber the key/value heads (multi-query attention: StarCoder, Falcon), as Megatron-LM does.

The copied rows run with f (identity forward, all-reduce backward) on their output: each rank's
gradient of the copied keys and values covers its own query heads only, so the all-reduce gives
every copy the whole of it, hence the copies' whole weight gradient; their share of the input
gradient is passed on by each head's first copy alone and summed with the query rows' by the f on
the input."""
from __future__ import annotations

from typing import Tuple

import torch
import torch.nn.functional as F

from torchpp import ops
from torchpp.tensor_parallel.layouts import FusedQKV
from torchpp.tensor_parallel.sharding import PlanError, TPContext
from torchpp.tensor_parallel.utils import through_slot


def fused_qkv_layouts(out_features: int, dim: int, ctx: TPContext, name: str, grouped: bool) -> Tuple[FusedQKV, FusedQKV]:
    """(weight layout, bias layout) of a fused q/k/v linear of ``out_features`` outputs along
    ``dim``; its key/value heads are counted from its width and the context's query heads."""
    heads, head_dim = ctx.num_heads, ctx.head_dim
    if not heads or not head_dim:
        raise PlanError(f"torchpp plan: {name}: a fused query/key/value split needs the config's head counts")
    kv, odd = divmod(out_features // head_dim - heads, 2)
    if out_features % head_dim or odd or kv < 1 or heads % kv:
        raise PlanError(f"torchpp plan: {name} ({out_features} output features) is not {heads} query heads of "
                        f"{head_dim} and as many key as value heads")
    layout = FusedQKV(dim, head_dim, heads, kv, grouped)
    try:
        layout.check(ctx.size)
    except ValueError as error:
        raise PlanError(f"torchpp plan: {name}: {error}") from None
    return layout, FusedQKV(0, head_dim, heads, kv, grouped)


def copied_tail_linear(input: torch.Tensor, weight: torch.Tensor, bias, copied: int, group, slot: int = 0,
                       slots: int = 1, first: bool = True) -> torch.Tensor:
    """A column-split linear whose last ``copied`` output features are a copy of key/value head
    ``slot`` of ``slots`` (the module docstring says why f sits on their output). The copies'
    output enters f in its head's slot of a zero-padded row, so the all-reduce sums each head's
    gradient over its own copies only (several heads copied, each on its own ranks); only a head's
    first copy passes its share of the input gradient on, which f on the input then sums over the
    ranks with the query rows' shares: each head's share counted once."""
    own = weight.size(0) - copied
    shared = ops.copy_to_tp_region(input, group)
    head = F.linear(shared, weight[:own], None if bias is None else bias[:own])
    tail = F.linear(shared if first else shared.detach(), weight[own:], None if bias is None else bias[own:])
    tail = through_slot(tail, slot, slots, lambda row: ops.copy_to_tp_region(row, group))
    return torch.cat([head, tail], dim=-1)
