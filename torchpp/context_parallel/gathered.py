"""Attention over the whole sequence's keys, gathered once on every rank of the cp group, for
layers whose queries reach keys chosen by content rather than by position (DeepSeek's sparse
indexed attention: ``indexed``), keys the model adds of its own (DeepSeek-V4's compressed entries:
``compressed``), or whose scores carry a bias by distance or by key (Inkling's relative positions:
``relative_bias``; Doge's dynamic mask: ``dynamic_mask``). Masks are this rank's rows
[b, 1, s_local, s] by global position; the keys' and values' gradients reduce-scatter back to the
ranks holding them. Attention runs through PyTorch's SDPA: with a boolean mask the mask
[s_local, s (+ extra keys)] is the one quadratic tensor, 1/cp of the one transformers' SDPA path
holds on one process; a bias is a float mask per head, as large as the scores it biases.
"""
from __future__ import annotations

import inspect
from typing import Optional

import torch
import torch.nn.functional as F
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


def gathering_output(cp):
    """A forward hook replacing a projection's output [b, s_local, ...] with every rank's, in order
    (its gradient summed back to the rank it came from)."""
    def hook(projection, args, output):
        return gather_keys(cp, output, dim=1)
    return hook


def giving_visible_mask(cp):
    """A forward pre-hook handing an attention module this rank's rows of the mask by position
    (``visible_keys``) as its ``attention_mask``."""
    def hook(module, args, kwargs):
        hidden = call_argument(module.forward, args, kwargs, "hidden_states")
        position_ids = call_argument(module.forward, args, kwargs, "position_ids")
        if not isinstance(position_ids, torch.Tensor):  # (given among **kwargs, or to the layer alone)
            position_ids = kwargs.get("position_ids", cp.layer_positions.get("latest"))
        mask = visible_keys(cp, module, hidden.size(0), hidden.size(1), position_ids, hidden.device)
        return with_argument(module.forward, args, kwargs, "attention_mask", mask)
    return hook


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


SINK_COLUMNS = 8  # (a whole block of extra columns keeps fused kernels' head-width alignment)


def masked_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, allowed: torch.Tensor,
                     scaling: Optional[float], sinks: Optional[torch.Tensor] = None,
                     bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Softmax attention of ``query`` [b, h, s_q, d] to ``key``/``value`` [b, h_kv, s_k, d(_v)]
    where ``allowed`` [b, 1, s_q, s_k], scores plus an additive ``bias`` [b, h or 1, s_q, s_k]
    (Inkling's relative positions), with ``sinks`` in each denominator: one logit per head [h]
    (GPT-OSS's, DeepSeek-V4's) or per head and query [b, h, s_q, 1] (Inkling 2's). Returns
    [b, s_q, h, d_v].

    Runs PyTorch's SDPA with the mask, whose fused kernels (flash on CPU, memory-efficient on CUDA)
    keep no scores: without a bias the boolean mask is the only quadratic tensor. A sink is one
    more key with a zero value that every query sees: the key holds a 1 in an extra column where
    each query holds ``sink / scale``, so its score is the sink and its gradient reaches it. Keys
    and values of different widths (MLA) are zero-padded to one width, as fused kernels need."""
    batch, heads, length, _ = query.shape
    scale = scaling if scaling is not None else query.size(-1) ** -0.5
    value_dim = value.size(-1)
    mask = allowed if bias is None else bias.to(query.dtype).masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        logit = (sinks.to(query.dtype) / scale)
        logit = logit.reshape(1, heads, 1, 1) if logit.dim() == 1 else logit
        query = torch.cat([query, logit.expand(batch, heads, length, 1),
                           query.new_zeros(batch, heads, length, SINK_COLUMNS - 1)], dim=-1)
        sink_key = torch.cat([key.new_zeros(batch, key.size(1), 1, key.size(-1)), key.new_ones(batch, key.size(1), 1, 1),
                              key.new_zeros(batch, key.size(1), 1, SINK_COLUMNS - 1)], dim=-1)
        key = torch.cat([torch.cat([key, key.new_zeros(*key.shape[:-1], SINK_COLUMNS)], dim=-1), sink_key], dim=2)
        value = torch.cat([value, value.new_zeros(batch, value.size(1), 1, value_dim)], dim=2)
        seen = mask.new_ones(*mask.shape[:-1], 1) if bias is None else mask.new_zeros(*mask.shape[:-1], 1)
        mask = torch.cat([mask, seen], dim=-1)
    width = max(query.size(-1), value.size(-1))
    query, key, value = (F.pad(t, (0, width - t.size(-1))) for t in (query, key, value))
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale,
                                         enable_gqa=key.size(1) != heads)
    return out[..., :value_dim].transpose(1, 2).contiguous()
