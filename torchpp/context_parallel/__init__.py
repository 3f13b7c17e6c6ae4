"""Context parallelism: the sequence split over the ranks of a group, attention exchanging keys/values.

Each of c ranks holds a shard of every sequence. With the "zigzag" layout the sequence is cut
into 2c chunks and rank r holds chunks r and 2c-1-r, so causal attention costs every rank the
same; "contiguous" gives rank r the r-th of c chunks. ``attention`` runs on this rank's shard:
``mode="ring"`` passes key/value shards around the ring (the next transfer overlapping the
current block's compute), ``mode="all-gather"`` gathers them once, ``mode="all-to-all"`` trades
heads for the sequence (DeepSpeed-Ulysses: each rank attends with 1/c of the heads over the whole
sequence), ``mode="all-to-all+ring"`` both (all-to-all inside groups of consecutive ranks, the
ring across them: ``hierarchical``). Block results merge by log-sum-exp; the backward passes
key/value gradients around the ring (or reduce-scatters them, or trades them back).

| function            | what                                                        |
|---------------------|-------------------------------------------------------------|
| shard_sequence      | this rank's shard of a full-sequence tensor (no communication) |
| unshard_sequence    | all-gather of the shards, back in sequence order            |
| attention           | softmax attention of this rank's queries to the whole sequence |
| sequence_positions  | the global positions this rank's shard holds                |
| hierarchical_groups | the all-to-all and ring groups of mode "all-to-all+ring"    |

Model-level integration: ``parallelize(model, cp=)`` (``torchpp.context_parallel.hf``: attention;
``gathered`` with ``indexed``, ``compressed``, ``relative_bias`` and ``dynamic_mask``: attention to
keys beyond the shard, chosen by content or of the model's own; ``halo``: short convolutions;
``chunk_states`` with ``delta_rule``, ``mamba``, ``selective_scan``, ``rg_lru`` and ``lightning``:
linear recurrences). See docs/context_parallel.md.
"""
from __future__ import annotations

from typing import List, Optional, Tuple, Union

import torch
import torch.nn.functional as F

import torchpp  # noqa: F401  (registers torch.ops.torchpp)
from torchpp.ops import GroupLike, gather_from_sp_region, gather_from_tp_region, group_of
from torchpp.context_parallel.hierarchical import hierarchical_groups

LAYOUTS = ("zigzag", "contiguous")
MODES = ("ring", "all-gather", "all-to-all", "all-to-all+ring")

__all__ = ["LAYOUTS", "MODES", "attention", "chunk_indices", "hierarchical_groups", "sequence_positions",
           "shard_sequence", "unshard_sequence"]


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"torchpp.context_parallel: layout must be one of {LAYOUTS}, got {layout!r}")


def chunk_indices(rank: int, size: int, layout: str = "zigzag") -> List[int]:
    """The chunks of the sequence that ``rank`` of ``size`` holds, in shard order: [r] of c chunks
    (contiguous) or [r, 2c-1-r] of 2c (zigzag)."""
    _check_layout(layout)
    return [rank] if layout == "contiguous" else [rank, 2 * size - 1 - rank]


def _num_chunks(size: int, layout: str) -> int:
    return size if layout == "contiguous" else 2 * size


def _chunk_length(seq_len: int, size: int, layout: str) -> int:
    chunks = _num_chunks(size, layout)
    if seq_len % chunks:
        cut = "2c" if layout == "zigzag" else "c"
        raise ValueError(f"torchpp.context_parallel: the {layout} layout cuts the sequence into {cut} = {chunks} "
                         f"equal chunks (c = {size} ranks), but its length {seq_len} is not divisible by {chunks}")
    return seq_len // chunks


def sequence_positions(seq_len: int, group: GroupLike = None, layout: str = "zigzag",
                       device: Optional[torch.device] = None) -> torch.Tensor:
    """The global positions (0 .. seq_len-1) of the tokens this rank's shard holds, in shard order.

    Args:
        seq_len: the full sequence length.
        group: the context-parallel group (ProcessGroup, name, or None for the world).
        layout: "zigzag" or "contiguous".
        device: where to create the tensor.
    """
    group = group_of(group)
    n = _chunk_length(seq_len, group.size(), layout)
    chunks = chunk_indices(group.rank(), group.size(), layout)
    return torch.cat([torch.arange(c * n, (c + 1) * n, device=device) for c in chunks])


def shard_sequence(x: torch.Tensor, group: GroupLike = None, dim: int = 1, layout: str = "zigzag") -> torch.Tensor:
    """This rank's shard of ``x`` along its sequence dimension ``dim`` (every rank holds all of x).

    No communication; differentiable (the gradient of x is zero outside this rank's chunks).

    Args:
        x: a full-sequence tensor, e.g. token ids [b, s] or hidden states [b, s, h].
        group: the context-parallel group (ProcessGroup, name, or None for the world).
        dim: the sequence dimension.
        layout: "zigzag" (rank r keeps chunks r and 2c-1-r of 2c) or "contiguous" (chunk r of c).

    Raises:
        ValueError: when the sequence length is not divisible by 2c (zigzag) or c (contiguous).
    """
    group = group_of(group)
    n = _chunk_length(x.size(dim), group.size(), layout)
    chunks = chunk_indices(group.rank(), group.size(), layout)
    return torch.cat([x.narrow(dim, c * n, n) for c in chunks], dim=dim)


def unshard_sequence(x: torch.Tensor, group: GroupLike = None, dim: int = 1, layout: str = "zigzag",
                     sum_gradients: bool = False) -> torch.Tensor:
    """The full sequence from every rank's shard ``x`` (all-gather along ``dim``, put back in order).

    Differentiable as Megatron's gather: the backward keeps this rank's part of the gradient; with
    ``sum_gradients`` it reduce-scatters (each rank's result feeding a different computation, as
    gathered keys feed each rank's own queries).

    Args:
        x: this rank's shard (as shard_sequence returns it, or a model's output on it).
        group: the context-parallel group.
        dim: the sequence dimension.
        layout: the layout the shard was taken with.
        sum_gradients: sum the gradient over the ranks (sequence parallelism's gather) instead of
            keeping this rank's part.
    """
    _check_layout(layout)
    group = group_of(group)
    size = group.size()
    dim = dim % x.dim()
    pieces = len(chunk_indices(0, size, layout))
    if x.size(dim) % pieces:
        raise ValueError(f"torchpp.context_parallel: a {layout} shard holds {pieces} equal chunks, but its length "
                         f"{x.size(dim)} along dim {dim} is odd")
    gather = gather_from_sp_region if sum_gradients else gather_from_tp_region
    gathered = gather(x, group, dim) if size > 1 else x  # rank-major shards
    n = x.size(dim) // pieces
    order = [0] * _num_chunks(size, layout)
    for rank in range(size):
        for piece, chunk in enumerate(chunk_indices(rank, size, layout)):
            order[chunk] = rank * pieces + piece
    return torch.cat([gathered.narrow(dim, i * n, n) for i in order], dim=dim)


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    group: Union[GroupLike, Tuple[GroupLike, GroupLike]] = None,
    *,
    causal: bool = True,
    scale: Optional[float] = None,
    mode: str = "ring",
    layout: str = "zigzag",
    segment_ids: Optional[torch.Tensor] = None,
    window: Optional[int] = None,
    sinks: Optional[torch.Tensor] = None,
    softcap: Optional[float] = None,
    alibi_slopes: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Softmax attention of this rank's query shard to the whole (sharded) sequence.

    Equals ``torch.nn.functional.scaled_dot_product_attention`` on the full sequence, restricted
    to this rank's queries (``shard_sequence`` of its output), in value and gradients.

    Args:
        query: [b, heads, s_local, d], this rank's shard.
        key: [b, kv_heads, s_local, d]; heads must be a multiple of kv_heads (grouped-query
            attention: query head j uses key head j // (heads / kv_heads)).
        value: [b, kv_heads, s_local, d_v]; d_v may differ from d (MLA), the narrower of the
            two zero-padded for the blocks.
        group: the context-parallel group (ProcessGroup, name, or None for the world); with mode
            "all-to-all+ring", the pair ``hierarchical_groups(a, cp_group)`` returns.
        causal: each token sees the tokens at or before its global position.
        scale: score scale; default 1/sqrt(d).
        mode: "ring" (key/value shards passed around the ring, transfers overlapping compute),
            "all-gather" (gathered once; simpler, c times the key/value memory) or "all-to-all"
            (DeepSpeed-Ulysses: heads traded for the sequence, each rank attending with heads / c
            heads over the whole sequence; the group size must divide the heads, key/value heads
            it does not divide are repeated; a rank's traffic does not grow with c), or
            "all-to-all+ring" (hierarchical, Megatron's "a2a+p2p": all-to-all inside groups of a
            consecutive ranks, which a must divide the heads, the ring across the c / a groups).
        layout: how the sequence was sharded: "zigzag" or "contiguous".
        segment_ids: [b, s_local] integer ids of this rank's tokens; tokens attend only to tokens
            of the same id (packed sequences). None: one sequence per row.
        window: a sliding window: token i sees tokens j with i - window < j, as transformers'
            sliding-window layers (Mistral, Gemma 3, GPT-OSS); without ``causal``, those with
            |i - j| < window (EmbeddingGemma2's, Ultrabert's). Blocks wholly beyond every query's
            window are skipped. None: every earlier token (every token, without ``causal``).
        sinks: [heads] attention sinks (GPT-OSS): one learned logit per head added to each
            softmax's denominator, attending to nothing; they get their gradient.
        softcap: scores capped to ``softcap * tanh(scores / softcap)`` before the softmax (Gemma 2's
            attention logit softcapping); such blocks run on matmul + softmax, the fused kernels
            having no cap. None: uncapped.
        alibi_slopes: [heads] ALiBi (Bloom, MPT): ``slope_h * (j - i)`` added to head h's score of
            query i for key j, by global position; such blocks run on matmul + softmax. None: no bias.

    Returns:
        [b, heads, s_local, d], this rank's shard of the output.
    """
    _check_layout(layout)
    op, groups = _op_and_groups(mode, group)
    if window is not None and window <= 0:
        raise ValueError(f"torchpp.context_parallel.attention: window must be positive (None: no window), got {window}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"torchpp.context_parallel.attention: softcap must be positive (None: none), got {softcap}")
    key_dim, value_dim = key.size(-1), value.size(-1)
    if key_dim != value_dim:  # (MLA: DeepSeek-V3's keys are 192 wide, its values 128) zeros add nothing to either
        scale = key_dim ** -0.5 if scale is None else scale
        width = max(key_dim, value_dim)
        query, key, value = (F.pad(t, (0, width - t.size(-1))) for t in (query, key, value))
    out = op(query, key, value, segment_ids, *groups, causal, scale, layout, window or 0, sinks, softcap or 0.0,
             alibi_slopes)
    return out[..., :value_dim] if out.size(-1) != value_dim else out


def _op_and_groups(mode: str, group) -> tuple:
    """The op of ``mode`` and its groups' arguments: (name, size), or both groups' for all-to-all+ring."""
    ops = {"ring": torch.ops.torchpp.ring_attention, "all-gather": torch.ops.torchpp.all_gather_attention,
           "all-to-all": torch.ops.torchpp.all_to_all_attention,
           "all-to-all+ring": torch.ops.torchpp.all_to_all_ring_attention}
    if mode not in ops:
        raise ValueError(f"torchpp.context_parallel.attention: mode must be one of {MODES}, got {mode!r}")
    if mode != "all-to-all+ring":
        group = group_of(group)
        return ops[mode], (group.group_name, group.size())
    if not (isinstance(group, (tuple, list)) and len(group) == 2):
        raise ValueError(f"torchpp.context_parallel.attention: mode 'all-to-all+ring' takes group=(all-to-all group, "
                         f"ring group), as hierarchical_groups returns them, got {group!r}")
    inner, ring = (group_of(g) for g in group)
    return ops[mode], (inner.group_name, inner.size(), ring.group_name, ring.size())
