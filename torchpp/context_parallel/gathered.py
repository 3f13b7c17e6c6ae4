"""Attention over the whole sequence's keys, gathered once on every rank of the cp group, for
layers whose queries reach keys chosen by content rather than by position (DeepSeek's sparse
indexed attention: ``indexed``) or keys the model adds of its own (DeepSeek-V4's compressed
entries: ``compressed``). Masks are this rank's rows [b, 1, s_local, s] by global position; the
keys' and values' gradients reduce-scatter back to the ranks holding them. Scores are dense over
[s_local, s (+ extra keys)], 1/cp of what transformers' eager or SDPA path holds on one process.
"""
from __future__ import annotations

import inspect
from typing import Optional

import torch
from torch import nn

from torchpp.context_parallel import unshard_sequence


def gather_keys(cp, x: torch.Tensor, dim: int = 2) -> torch.Tensor:
    """Every rank's shard of ``x`` in sequence order; the gradient summed back to its rank."""
    return unshard_sequence(x, cp.group, dim=dim, layout=cp.layout, sum_gradients=True)


def with_argument(forward, args, kwargs, name: str, value):
    """(args, kwargs) of a call to ``forward`` with argument ``name`` set, given by name or position."""
    bound = inspect.signature(forward).bind_partial(*args, **kwargs)
    bound.arguments[name] = value
    return bound.args, bound.kwargs


def call_argument(forward, args, kwargs, name: str):
    return inspect.signature(forward).bind_partial(*args, **kwargs).arguments.get(name)


def visible_keys(cp, module: nn.Module, batch: int, local_len: int, position_ids: Optional[torch.Tensor],
                 device: torch.device) -> torch.Tensor:
    """[b, 1, s_local, s] bool: which keys (global order) each of this rank's queries may see by
    position: causal (as the module is masked), within its ``sliding_window``, in its packed row."""
    from torchpp.context_parallel.hf import _segment_ids
    from torchpp.context_parallel.hf_support import masked_causally

    query_at = cp.positions(local_len * cp.size, device)[:, None]
    key_at = torch.arange(local_len * cp.size, device=device)[None, :]
    visible = (key_at <= query_at) if masked_causally(module) else torch.ones_like(key_at == query_at)
    window = getattr(module, "sliding_window", None)
    if isinstance(window, int):
        visible = visible & (key_at > query_at - window)
    visible = visible.expand(batch, -1, -1)
    segments = _segment_ids(cp, position_ids, local_len)
    if segments is not None:  # packed rows: a token sees its own sequence only
        segments = segments.expand(batch, -1)
        every = unshard_sequence(segments, cp.group, dim=1, layout=cp.layout)
        visible = visible & (segments[:, :, None] == every[:, None, :])
    return visible.unsqueeze(1)


def dense_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, allowed: torch.Tensor,
                    scaling: Optional[float], sinks: Optional[torch.Tensor] = None,
                    bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Softmax attention of ``query`` [b, h, s_q, d] to ``key``/``value`` [b, h_kv, s_k, d(_v)]
    where ``allowed`` [b, 1, s_q, s_k] (plus an additive ``bias`` of that shape), with per-head
    ``sinks`` in each denominator (GPT-OSS's, DeepSeek-V4's). Returns [b, s_q, h, d_v]."""
    batch, heads, length, _ = query.shape
    groups = heads // key.size(1)
    q = query.reshape(batch, key.size(1), groups, length, -1)  # grouped heads broadcast over their key head
    scale = scaling if scaling is not None else query.size(-1) ** -0.5
    scores = torch.matmul(q, key.unsqueeze(2).transpose(-1, -2)) * scale
    if bias is not None:
        scores = scores + bias.unsqueeze(2).to(scores.dtype)
    scores = scores.masked_fill(~allowed.unsqueeze(2), float("-inf"))
    if sinks is not None:
        sink = sinks.reshape(1, key.size(1), groups, 1, 1).to(scores.dtype).expand(*scores.shape[:-1], 1)
        scores = torch.cat([scores, sink], dim=-1)
    probs = torch.softmax(scores - scores.amax(dim=-1, keepdim=True).detach(), dim=-1)
    if sinks is not None:
        probs = probs[..., :-1]
    out = torch.matmul(probs.to(value.dtype), value.unsqueeze(2))  # [b, h_kv, g, s_q, d_v]
    return out.reshape(batch, heads, length, -1).transpose(1, 2).contiguous()
