"""Fused query/key/value projections under TP (``packed_qkv_colwise``, ``packed_qkv_grouped_colwise``):
each rank keeps its query heads and the key/value heads they read, copies of them where the ranks
outnumber the key/value heads (multi-query attention: StarCoder, Falcon), as Megatron-LM does.

The copied rows run on the input as it is, with f (identity forward, all-reduce backward) on
their output: each rank's gradient of the copied keys and values covers its own query heads only,
so the all-reduce gives every rank the whole of it, hence the copies' whole weight gradient, and
their share of the input gradient once (the query rows' share is summed by the f on their input)."""
from __future__ import annotations

from typing import Tuple

import torch
import torch.nn.functional as F

from torchpp import ops
from torchpp.tensor_parallel.layouts import FusedQKV
from torchpp.tensor_parallel.sharding import PlanError, TPContext


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


def copied_tail_linear(input: torch.Tensor, weight: torch.Tensor, bias, copied: int, group) -> torch.Tensor:
    """A column-split linear whose last ``copied`` output features are copies every rank holds
    (the module docstring says why f sits on their output)."""
    own = weight.size(0) - copied
    head = F.linear(ops.copy_to_tp_region(input, group), weight[:own], None if bias is None else bias[:own])
    tail = F.linear(input, weight[own:], None if bias is None else bias[own:])
    return torch.cat([head, ops.copy_to_tp_region(tail, group)], dim=-1)
