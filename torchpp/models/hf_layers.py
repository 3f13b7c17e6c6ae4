"""Tensor-parallel decoder pieces that run a Hugging Face causal LM's converted weights.

Activations are batch-first, [b, s, h], as in transformers; with sequence parallelism the
regions outside attention/MLP hold [b, s/t, h] (sequence dim 1). Rotary tables and causal
masks are computed inside each pipeline stage, so nothing but the hidden states travels
between stages; with a padding mask or position ids, those travel too (a tuple message of
integer tensors, which need no gradient).
"""
from __future__ import annotations

import contextlib
from typing import Callable, Dict, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from torchpp import recompute
from torchpp import tensor_parallel as tp

SEQUENCE_DIM = 1
Rope = Optional[Tuple[torch.Tensor, torch.Tensor]]


def tp_dropout(x: torch.Tensor, p: float, training: bool, split_over_tp: bool) -> torch.Tensor:
    """Dropout whose mask differs per TP rank exactly when ``x`` differs per TP rank."""
    if p == 0.0 or not training:
        return x
    with tp.get_rng_tracker().fork() if split_over_tp else contextlib.nullcontext():
        return F.dropout(x, p, training)


def causal_mask(seq_len: int, device) -> torch.Tensor:
    """True where a query (row) may see a key (column): itself and earlier positions."""
    return torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()


def sliding_window_mask(seq_len: int, window: int, device) -> torch.Tensor:
    """Causal mask that also hides keys ``window`` or more positions back (Mistral)."""
    positions = torch.arange(seq_len, device=device)
    distance = positions[:, None] - positions[None, :]
    return (distance >= 0) & (distance < window)


def packed_segments(position_ids: torch.Tensor) -> Optional[torch.Tensor]:
    """Which packed sequence each token belongs to, [b, s], from position ids that restart
    within a row (transformers' rule: a new sequence wherever a position is not its
    predecessor's plus one); None when every row holds one sequence."""
    previous = torch.cat([position_ids[:, :1] - 1, position_ids[:, :-1]], dim=1)
    segments = (position_ids - previous != 1).cumsum(dim=1)
    return None if bool((segments[:, -1] == 0).all()) else segments


def attention_core(q, k, v, *, scaling: float, dropout: float, training: bool,
                   sliding_window: Optional[int], keep: Optional[torch.Tensor] = None,
                   segments: Optional[torch.Tensor] = None, softcap: Optional[float] = None) -> torch.Tensor:
    """Causal attention of this rank's heads: [b, hq, s, d] x [b, hkv, s, d] -> [b, hq, s, d].
    ``keep`` [b, s] (bool) hides the keys of padding tokens, as transformers' attention_mask;
    a query that sees no key at all (left padding) gets zeros, as from SDPA in transformers.
    ``segments`` [b, s] confines each token to its own packed sequence (``packed_segments``).
    ``softcap`` bounds the scores to (-softcap, softcap) by tanh before the mask (Gemma 2).

    The piece selective recompute redoes: it holds the s x s scores and probabilities.
    """
    seq_len = q.shape[2]
    mask = None
    if sliding_window is not None and sliding_window < seq_len:
        mask = sliding_window_mask(seq_len, sliding_window, q.device)
    if keep is not None or segments is not None:
        causal = mask if mask is not None else causal_mask(seq_len, q.device)
        mask = causal[None, None]
        if keep is not None:
            mask = mask & keep[:, None, None, :]
        if segments is not None:
            mask = mask & (segments[:, None, :, None] == segments[:, None, None, :])
    p = dropout if training else 0.0
    if softcap is not None:
        return _softcapped_attention(q, k, v, mask, scaling, softcap, p)
    # Heads are split over TP ranks, so attention dropout draws from the per-TP-rank stream.
    with tp.get_rng_tracker().fork() if p > 0 else contextlib.nullcontext():
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=p, is_causal=mask is None, scale=scaling,
            enable_gqa=q.shape[1] != k.shape[1],
        )


def _softcapped_attention(q, k, v, mask: Optional[torch.Tensor], scaling: float, softcap: float,
                          p: float) -> torch.Tensor:
    # SDPA cannot cap the scores, so this spells attention out as transformers' eager path does:
    # the mask adds the dtype's minimum, so a query with no key left gets uniform weights (not
    # NaN) and, as there, its gradient still reaches the scores.
    if k.shape[1] != q.shape[1]:
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    scores = torch.tanh(torch.matmul(q, k.transpose(2, 3)) * scaling / softcap) * softcap
    if mask is None:
        mask = causal_mask(q.shape[2], q.device)
    bias = torch.zeros(mask.shape, dtype=scores.dtype, device=scores.device)
    scores = scores + bias.masked_fill_(~mask, torch.finfo(scores.dtype).min)
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    if p > 0:
        with tp.get_rng_tracker().fork():
            probs = F.dropout(probs, p)
    return torch.matmul(probs, v)


class SeparateQKV(nn.Module):
    """Llama and most of its family: q, k and v column-parallel projections (this rank's heads)."""

    def __init__(self, q_proj: nn.Module, k_proj: nn.Module, v_proj: nn.Module):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = q_proj, k_proj, v_proj

    def forward(self, x: torch.Tensor):
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)


class FusedQKV(nn.Module):
    """GPT-2, Phi-3: one column-parallel projection whose rank-local output is [q_r, k_r, v_r].

    Args:
        c_attn: the projection (rows grouped by ``hf_convert.group_fused``).
        sizes: this rank's q, k and v widths (k and v narrower than q under GQA).
    """

    def __init__(self, c_attn: nn.Module, sizes: Sequence[int]):
        super().__init__()
        self.c_attn, self.sizes = c_attn, list(sizes)

    def forward(self, x: torch.Tensor):
        return self.c_attn(x).split(self.sizes, dim=-1)


class ParallelSelfAttention(nn.Module):
    """Self-attention over this rank's heads: projections by column, output by row.

    Args:
        qkv: module returning this rank's (q, k, v) projections of the input.
        out_proj: RowParallelLinear back to the hidden size.
        num_heads: this rank's query heads.
        num_kv_heads: this rank's key/value heads (GQA: fewer than num_heads).
        head_dim: size of one head.
        scaling: softmax scale of the scores.
        dropout: attention-probability dropout.
        apply_rope: ``apply_rope(q, k, cos, sin)`` for rotary models; None otherwise.
        sliding_window: Mistral's (or a Qwen2 layer's) window: keys that far back or further are masked; or None.
        recompute_core: recompute the attention core in backward (selective recompute).
        q_norm, k_norm: Qwen3's norms over each query / key head, before rotary; or None.
        softcap: Gemma 2's bound on the attention scores (tanh), or None.
    """

    def __init__(self, qkv: nn.Module, out_proj: nn.Module, *, num_heads: int, num_kv_heads: int, head_dim: int,
                 scaling: float, dropout: float = 0.0, apply_rope: Optional[Callable] = None,
                 sliding_window: Optional[int] = None, recompute_core: bool = False,
                 q_norm: Optional[nn.Module] = None, k_norm: Optional[nn.Module] = None,
                 softcap: Optional[float] = None):
        super().__init__()
        self.softcap = softcap
        self.qkv = qkv
        self.out_proj = out_proj
        self.q_norm, self.k_norm = q_norm, k_norm
        for norm in (q_norm, k_norm):
            if norm is not None:  # replicated, but each TP rank normalises only its own heads
                tp.mark_sequence_parallel(norm)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scaling, self.dropout = scaling, dropout
        self.apply_rope = apply_rope
        self.sliding_window = sliding_window
        self.recompute_core = recompute_core

    def _heads(self, t: torch.Tensor, heads: int) -> torch.Tensor:  # [b, s, n*d] -> [b, n, s, d]
        return t.view(t.shape[0], t.shape[1], heads, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor, rope: Rope = None, keep: Optional[torch.Tensor] = None,
                segments: Optional[torch.Tensor] = None) -> torch.Tensor:
        q, k, v = self.qkv(x)  # full sequence even under SP: the column layers all-gathered it
        q, k, v = self._heads(q, self.num_heads), self._heads(k, self.num_kv_heads), self._heads(v, self.num_kv_heads)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.apply_rope is not None:
            q, k = self.apply_rope(q, k, *rope)
        options = dict(scaling=self.scaling, dropout=self.dropout, training=self.training,
                       sliding_window=self.sliding_window, keep=keep, segments=segments, softcap=self.softcap)
        if self.recompute_core:
            core = recompute.checkpoint(attention_core, q, k, v, **options)
        else:
            core = attention_core(q, k, v, **options)
        return self.out_proj(core.transpose(1, 2).flatten(2))

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim} (per rank), "
                f"sliding_window={self.sliding_window}, softcap={self.softcap}, recompute_core={self.recompute_core}")


class GatedMLP(nn.Module):
    """Llama-family MLP: down(act(gate(x)) * up(x)), gate/up by column, down by row."""

    def __init__(self, gate_proj: nn.Module, up_proj: nn.Module, down_proj: nn.Module, act: Callable):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj, self.act = gate_proj, up_proj, down_proj, act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class FusedGatedMLP(nn.Module):
    """Phi-3 MLP: one column-parallel gate_up projection whose rank-local output is [gate_r, up_r]."""

    def __init__(self, gate_up_proj: nn.Module, down_proj: nn.Module, act: Callable):
        super().__init__()
        self.gate_up_proj, self.down_proj, self.act = gate_up_proj, down_proj, act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class MLP(nn.Module):
    """GPT-2 MLP: c_proj(act(c_fc(x))), c_fc by column, c_proj by row."""

    def __init__(self, c_fc: nn.Module, c_proj: nn.Module, act: Callable):
        super().__init__()
        self.c_fc, self.c_proj, self.act = c_fc, c_proj, act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class DecoderBlock(nn.Module):
    """Pre-norm residual block: x + drop(attn(norm1(x))), then + drop(mlp(norm2(x))); with
    Gemma 2's sandwich norms, x + post_norm1(attn(norm1(x))), then + post_norm2(mlp(norm2(x))).

    Args:
        norm1, norm2: the HF block's norms before attention and MLP (copied, replicated over TP).
        attention: ParallelSelfAttention.
        mlp: GatedMLP or MLP.
        dropout: residual dropout (GPT-2's resid_pdrop; 0 for Llama/Mistral).
        sequence_parallel: the residual stream is this rank's sequence slice.
        post_norm1, post_norm2: norms of the attention and MLP outputs (Gemma 2), or None.
        rope_key: which of the stage's rotary tables the block uses (Gemma 3's layer type), or
            None when there is one.
    """

    def __init__(self, norm1: nn.Module, attention: nn.Module, norm2: nn.Module, mlp: nn.Module,
                 dropout: float = 0.0, sequence_parallel: bool = False, post_norm1: Optional[nn.Module] = None,
                 post_norm2: Optional[nn.Module] = None, rope_key: Optional[str] = None):
        super().__init__()
        self.rope_key = rope_key
        self.norm1, self.attention, self.norm2, self.mlp = norm1, attention, norm2, mlp
        self.post_norm1, self.post_norm2 = post_norm1, post_norm2
        self.dropout = dropout
        self.sequence_parallel = sequence_parallel
        if sequence_parallel:  # norms see a sequence slice: their gradients are partial per TP rank
            for norm in (norm1, norm2, post_norm1, post_norm2):
                if norm is not None:
                    tp.mark_sequence_parallel(norm)

    def forward(self, x: torch.Tensor, rope: Rope = None, keep: Optional[torch.Tensor] = None,
                segments: Optional[torch.Tensor] = None) -> torch.Tensor:
        drop = lambda y: tp_dropout(y, self.dropout, self.training, self.sequence_parallel)  # noqa: E731
        attended = self.attention(self.norm1(x), rope, keep, segments)
        x = x + drop(attended if self.post_norm1 is None else self.post_norm1(attended))
        transformed = self.mlp(self.norm2(x))
        return x + drop(transformed if self.post_norm2 is None else self.post_norm2(transformed))


class ParallelTokenEmbedding(nn.Module):
    """Vocab-parallel token embedding, plus learned positions (GPT-2) and dropout.

    Args:
        tokens: VocabParallelEmbedding.
        positions: nn.Embedding of positions, or None (rotary models).
        dropout: embedding dropout.
        sequence_parallel: return this rank's sequence slice.
        scale: factor on the token embeddings (Gemma's sqrt(hidden)), or None.
    """

    def __init__(self, tokens: tp.VocabParallelEmbedding, positions: Optional[nn.Embedding] = None,
                 dropout: float = 0.0, sequence_parallel: bool = False, scale: Optional[float] = None):
        super().__init__()
        self.tokens, self.positions = tokens, positions
        # A buffer, as transformers keeps it: it rounds to the table's dtype before multiplying.
        self.register_buffer("scale", None if scale is None else torch.tensor(scale), persistent=False)
        self.dropout = dropout
        self.sequence_parallel = sequence_parallel
        if sequence_parallel and positions is not None:
            tp.mark_sequence_parallel(positions)

    def forward(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        hidden = self.tokens(input_ids)
        if self.scale is not None:
            hidden = hidden * self.scale.to(self.tokens.weight.dtype)
        if self.positions is not None:
            positions = position_ids if position_ids is not None else torch.arange(input_ids.shape[1],
                                                                                     device=input_ids.device)[None]
            if self.sequence_parallel:  # this rank's slice of the sequence
                group = self.tokens.group
                positions = positions.chunk(group.size(), dim=1)[dist.get_rank(group)]
            hidden = hidden + self.positions(positions)
        return tp_dropout(hidden, self.dropout, self.training, self.sequence_parallel)


class ParallelLMHead(nn.Module):
    """Final norm and the vocab-parallel output layer; returns this rank's logits [b, s, V/t],
    bounded to (-softcap, softcap) by tanh when ``softcap`` is given (Gemma 2)."""

    def __init__(self, norm: nn.Module, output: tp.ColumnParallelLinear, sequence_parallel: bool = False,
                 softcap: Optional[float] = None):
        super().__init__()
        self.norm, self.output = norm, output
        self.softcap = softcap
        if sequence_parallel:
            tp.mark_sequence_parallel(norm)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.output(self.norm(hidden))
        if self.softcap is not None:  # elementwise: each rank caps its own vocabulary slice
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


class CausalLMStage(nn.Module):
    """One pipeline stage of a wrapped causal LM: [embedding], blocks, [norm + head].

    Takes token ids [b, s] (first stage) or hidden states [b, s(/t), h] and returns hidden
    states, or this rank's vocabulary slice of the logits on the last stage. The first stage
    also takes transformers' ``attention_mask`` [b, s] (1: token, 0: padding) and
    ``position_ids`` [b, s]; position ids without a mask that restart within a row pack
    several sequences into it, each attending to itself alone (transformers' rule in
    training, without a cache). With either, a stage passes (hidden states, attention_mask,
    position_ids, packed segments) on to the next, defaults filled in.

    Args:
        embedding: ParallelTokenEmbedding on the first stage, else None.
        blocks: this stage's DecoderBlocks.
        head: ParallelLMHead on the last stage, else None.
        rotary: the HF rotary-embedding module (rotary models), else None.
        sequence_parallel: hidden states between blocks are sequence slices.
        tp_size: the TP size (the full sequence is tp_size slices under SP).
        recompute: None, "full" (checkpoint every block) or "selective" (set on the blocks).
    """

    def __init__(self, embedding: Optional[nn.Module], blocks, head: Optional[nn.Module],
                 rotary: Optional[nn.Module] = None, sequence_parallel: bool = False, tp_size: int = 1,
                 recompute: Optional[str] = None):
        super().__init__()
        self.embedding = embedding
        self.blocks = nn.ModuleList(blocks)
        self.head = head
        self.rotary = rotary
        self.sequence_parallel = sequence_parallel
        self.tp_size = tp_size
        self.recompute = recompute

    def _rope(self, hidden: torch.Tensor, position_ids: Optional[torch.Tensor]) -> Union[Rope, Dict[str, Rope]]:
        if self.rotary is None:
            return None
        if position_ids is None:
            seq_len = hidden.shape[1] * (self.tp_size if self.sequence_parallel else 1)
            position_ids = torch.arange(seq_len, device=hidden.device).unsqueeze(0)
        if getattr(self.rotary, "layer_types", None):  # Gemma 3: a table per attention type
            return {key: self.rotary(hidden, position_ids, key) for key in {block.rope_key for block in self.blocks}}
        return self.rotary(hidden, position_ids)

    def forward(self, x: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.Tensor] = None, segments: Optional[torch.Tensor] = None):
        extras = attention_mask is not None or position_ids is not None
        if self.embedding is not None:
            if position_ids is not None:
                position_ids = position_ids.expand(x.shape[0], -1)
            if position_ids is not None and attention_mask is None:
                segments = packed_segments(position_ids)
            x = self.embedding(x, position_ids)
        elif segments is not None and not bool(segments.any()):
            segments = None  # one sequence per row (the zeros a first stage passes on)
        rope = self._rope(x, position_ids)
        # An all-ones mask hides nothing: the plain causal path, as transformers does.
        keep = None if attention_mask is None or bool(attention_mask.all()) else attention_mask.bool()
        for block in self.blocks:
            block_rope = rope[block.rope_key] if isinstance(rope, dict) else rope
            if self.recompute == "full":
                x = recompute.checkpoint(block, x, block_rope, keep, segments)
            else:
                x = block(x, block_rope, keep, segments)
        if self.head is not None:
            return self.head(x)
        if not extras:
            return x
        rows, seq_len = x.shape[0], x.shape[1] * (self.tp_size if self.sequence_parallel else 1)
        defaults = torch.zeros(rows, seq_len, dtype=torch.long, device=x.device)
        return (x,
                attention_mask if attention_mask is not None else defaults + 1,
                position_ids if position_ids is not None else defaults + torch.arange(seq_len, device=x.device),
                segments if segments is not None else defaults)
