"""Turning Hugging Face projections into TP layers, and their shards back into HF tensors.

Every converted parameter is recorded with the HF state-dict name it came from and how the
TP shards relate to that tensor (``Export``, its ``Layout``), so a wrapped model can be
compared with, saved as, or loaded from the original's checkpoint (``hf_checkpoint``).
"""
from __future__ import annotations

import abc
import copy
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch
from torch import nn

from torchpp import tensor_parallel as tp
from torchpp.models.hf_layers import ParallelLMHead
from torchpp.tensor_parallel.embedding import pad_rows


class Layout(abc.ABC):
    """How one parameter's TP shards (in TP-rank order) relate to the HF tensor: calling it
    reassembles the HF tensor, ``shard`` cuts TP rank ``rank``'s shard out of it (loading)."""

    @abc.abstractmethod
    def __call__(self, shards: List[torch.Tensor]) -> torch.Tensor: ...

    @abc.abstractmethod
    def shard(self, full: torch.Tensor, rank: int, size: int, local_shape: torch.Size) -> torch.Tensor: ...


class _Replicated(Layout):
    def __call__(self, shards):
        return shards[0]

    def shard(self, full, rank, size, local_shape):
        return full


class Concatenated(Layout):
    def __init__(self, dim: int):
        self.dim = dim

    def __call__(self, shards):
        return torch.cat(shards, dim=self.dim)

    def shard(self, full, rank, size, local_shape):
        return full.narrow(self.dim, rank * local_shape[self.dim], local_shape[self.dim])


replicated = _Replicated()
cat_rows = Concatenated(0)
cat_columns = Concatenated(1)


class HeadCopies(Layout):
    """Row shards of a projection whose heads are each copied onto ``replicas`` consecutive TP
    ranks (key/value heads when tp exceeds them): one copy of each head makes the HF tensor."""

    def __init__(self, replicas: int):
        self.replicas = replicas

    def __call__(self, shards):
        return cat_rows(shards[:: self.replicas])

    def shard(self, full, rank, size, local_shape):
        return cat_rows.shard(full, rank // self.replicas, size // self.replicas, local_shape)


class TrimmedRows(Layout):
    """Concatenated vocabulary shards without the padding rows (zero rows when loading)."""

    def __init__(self, rows: int):
        self.rows = rows

    def __call__(self, shards):
        return cat_rows(shards)[: self.rows]

    def shard(self, full, rank, size, local_shape):
        return cat_rows.shard(pad_rows(full, local_shape[0] * size), rank, size, local_shape)


class Transposed(Layout):
    """For GPT-2's Conv1D, whose weight is the transpose ([in, out]) of nn.Linear's."""

    def __init__(self, inner: Layout):
        self.inner = inner

    def __call__(self, shards):
        return self.inner(shards).t()

    def shard(self, full, rank, size, local_shape):
        return self.inner.shard(full.t(), rank, size, local_shape)


@dataclass
class Export:
    """One wrapped parameter and the HF tensor it stands for."""

    hf_name: str
    param: nn.Parameter
    unshard: Layout


def linear_from_conv1d(conv: nn.Module) -> nn.Linear:
    """An nn.Linear computing what transformers' Conv1D (y = x W + b, W [in, out]) computes."""
    in_features, out_features = conv.weight.shape
    linear = nn.Linear(in_features, out_features, device="meta")
    linear.weight = nn.Parameter(conv.weight.detach().t().contiguous())
    linear.bias = nn.Parameter(conv.bias.detach().clone())
    return linear


def _regroup(t: torch.Tensor, sizes: Sequence[int], tp_size: int, dim: int = 0) -> torch.Tensor:
    # [a; b; ...] -> [a_0 b_0 ...; a_1 b_1 ...; ...]: rank r's chunk along dim holds its slice of each part.
    parts = [part.chunk(tp_size, dim) for part in t.split(list(sizes), dim)]
    return torch.cat([piece for rank in range(tp_size) for piece in (chunks[rank] for chunks in parts)], dim)


def group_fused(linear: nn.Linear, sizes: Sequence[int], tp_size: int) -> nn.Linear:
    """Reorders a fused projection's row blocks ([q; k; v] of ``sizes`` rows, or [gate; up]) into
    [q_0 k_0 v_0; q_1 k_1 v_1; ...] so that TP rank r's row chunk holds its share of each block."""
    for size in sizes:
        if size % tp_size:
            raise ValueError(f"torchpp.parallelize: tp={tp_size} must divide each fused block's rows {list(sizes)}")
    grouped = nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
    grouped.weight = nn.Parameter(_regroup(linear.weight.detach(), sizes, tp_size))
    if linear.bias is not None:
        grouped.bias = nn.Parameter(_regroup(linear.bias.detach(), sizes, tp_size))
    return grouped


class UngroupFused(Layout):
    """Inverse of ``group_fused`` on the TP shards: blocks of ``sizes`` along ``dim`` (the rows
    of a fused projection, or dim 1 of a stack of them, one per expert)."""

    def __init__(self, sizes: Sequence[int], tp_size: int, dim: int = 0):
        self.sizes, self.tp_size, self.dim = list(sizes), tp_size, dim

    def __call__(self, shards):
        local = [size // self.tp_size for size in self.sizes]
        per_rank = [shard.split(local, self.dim) for shard in shards]
        blocks = [torch.cat([pieces[block] for pieces in per_rank], self.dim) for block in range(len(self.sizes))]
        return torch.cat(blocks, self.dim)

    def shard(self, full, rank, size, local_shape):
        return Concatenated(self.dim).shard(_regroup(full, self.sizes, size, self.dim), rank, size, local_shape)


def copy_heads(linear: nn.Linear, head_dim: int, replicas: int) -> nn.Linear:
    """``linear`` with each head's rows repeated ``replicas`` times in place ([h0; h0; h1; h1]
    for 2), so a row split over heads * replicas TP ranks gives rank r a copy of head r // replicas."""
    def repeated(t: torch.Tensor) -> torch.Tensor:
        return t.detach().unflatten(0, (-1, head_dim)).repeat_interleave(replicas, 0).flatten(0, 1)

    copied = nn.Linear(linear.in_features, linear.out_features * replicas, bias=linear.bias is not None,
                       device="meta")
    copied.weight = nn.Parameter(repeated(linear.weight))
    if linear.bias is not None:
        copied.bias = nn.Parameter(repeated(linear.bias))
    return copied


def padded_linear(linear: nn.Linear, rows: int) -> nn.Linear:
    """``linear`` with zero output rows appended up to ``rows`` (vocabulary padding)."""
    if linear.out_features == rows:
        return linear
    padded = nn.Linear(linear.in_features, rows, bias=False, device="meta")
    padded.weight = nn.Parameter(pad_rows(linear.weight.detach(), rows))
    return padded


def column(linear: nn.Linear, **kwargs) -> tp.ColumnParallelLinear:
    return tp.ColumnParallelLinear.from_linear(linear, **kwargs)


def row(linear: nn.Linear, **kwargs) -> tp.RowParallelLinear:
    return tp.RowParallelLinear.from_linear(linear, input_is_parallel=True, **kwargs)


def export_linear(exports: List[Export], layer: nn.Module, hf_prefix: str, weight: Layout,
                  bias: Optional[Layout], conv1d: bool = False) -> None:
    """Records a TP linear's weight (and bias) under ``hf_prefix.weight`` / ``.bias``."""
    exports.append(Export(f"{hf_prefix}.weight", layer.weight, Transposed(weight) if conv1d else weight))
    if layer.bias is not None and bias is not None:
        exports.append(Export(f"{hf_prefix}.bias", layer.bias, bias))


def fused_column(ctx, linear: nn.Linear, blocks: Sequence[int], hf_prefix: str,
                 conv1d: bool = False) -> tp.ColumnParallelLinear:
    """A fused projection (``blocks``: its row blocks) as one column-parallel layer whose rank r
    holds its share of every block, exported under ``hf_prefix``."""
    layer = column(group_fused(linear, blocks, ctx.tp_size), **ctx.linear_kwargs)
    unshard = UngroupFused(blocks, ctx.tp_size)
    export_linear(ctx.exports, layer, hf_prefix, unshard, unshard, conv1d=conv1d)
    return layer


def export_module(exports: List[Export], module: nn.Module, hf_prefix: str) -> None:
    """Records every parameter of a module replicated across TP ranks (norms, positions)."""
    for name, param in module.named_parameters():
        exports.append(Export(f"{hf_prefix}.{name}", param, replicated))


def lm_head(ctx, norm: nn.Module, norm_name: str, output: nn.Linear, vocab_size: int,
            softcap: Optional[float] = None):
    """The last stage's final norm and vocab-parallel output projection (vocab padded to the TP
    size; logits capped by ``softcap``), exported under the HF names ``norm_name`` and
    ``lm_head.weight``."""
    norm = copy.deepcopy(norm)
    export_module(ctx.exports, norm, norm_name)
    projection = column(padded_linear(output, ctx.padded_vocab(vocab_size)), **ctx.linear_kwargs)
    ctx.exports.append(Export("lm_head.weight", projection.weight, TrimmedRows(vocab_size)))
    return ParallelLMHead(norm, projection, ctx.sequence_parallel, softcap)
