"""DeepSeek Sparse Attention (DSA) on a shard of the sequence: a lightweight indexer scores each
query against every key it may see and keeps its top k; attention then runs over those keys alone
(DeepSeek-V3.2, GLM-MoE-DSA, HY-V4, AXK2, Dots3 Note; layers of type ``indexed_attention``).

The keys a query picks may lie anywhere before it, so the keys are gathered once per layer, as in
``mode="all-gather"``: the indexer's keys (it runs without autograd) and the attention's keys and
values (their gradients reduce-scattered back). The model's own indexer runs unchanged:

- the cache it reads its keys from (``cache.update_indexer``) becomes one that hands it every
  rank's keys in sequence order, so its scores and top k are over global key indices;
- its attention module is given this rank's rows of the mask by global position (causal, packed
  rows, windows) instead of the full mask transformers builds on one process;
- transformers hands the top-k indices to any attention backend but eager and SDPA (``indices=``),
  and the cp attention function attends to the chosen keys the mask allows (``attend``).

Top-k ties (the indexer's ReLU zeroes many scores) are broken alike: every row is scored against
the whole sequence in its order, as on one process.
"""
from __future__ import annotations

import inspect
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from torchpp.context_parallel import unshard_sequence

LAYER_TYPE = "indexed_attention"

# Indexers by modeling module and class whose keys come through ``cache.update_indexer`` and whose
# result is the top-k key indices [b, s, k] (each checked against the unwrapped model in tests).
INDEXERS = (
    "modeling_deepseek_v32.DeepseekV32Indexer",
    "modeling_glm_moe_dsa.GlmMoeDsaIndexer",
    "modeling_hy_v4.HYV4Indexer",
    "modeling_axk2.AXK2Indexer",
    "modeling_dots3_note.Dots3NoteTextIndexer",
)


def _known(indexer: nn.Module) -> bool:
    return any(f"{cls.__module__.rpartition('.')[2]}.{cls.__name__}" in INDEXERS for cls in type(indexer).__mro__)


def _indexed_attention_modules(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    from torchpp.context_parallel.hf_support import layer_type

    return [(name, module) for name, module in model.named_modules()
            if hasattr(module, "indexer") and layer_type(module) == LAYER_TYPE]


def refusal(model: nn.Module) -> str:
    """Why a model with indexed-attention layers cannot run them on a shard ('' when it can)."""
    modules = _indexed_attention_modules(model)
    if not modules:
        return "sparse attention (an indexer picks each query's keys) in modules torchpp does not recognise"
    unknown = sorted({type(m.indexer).__name__ for _, m in modules if m.indexer is not None and not _known(m.indexer)})
    if unknown:
        return (f"sparse attention whose indexer ({unknown[0]}) picks keys otherwise than DeepSeek-V3.2's (top-k "
                f"key indices scored against keys read through cache.update_indexer, which torchpp gathers)")
    return ""


class GatheredIndexerKeys:
    """Stands in for the cache an indexer reads its keys from: returns every rank's keys, in order."""

    def __init__(self, cp):
        self.cp = cp

    def update_indexer(self, keys: torch.Tensor, layer_idx: int) -> torch.Tensor:
        return unshard_sequence(keys, self.cp.group, dim=1, layout=self.cp.layout)


def _with_argument(forward, args, kwargs, name: str, value):
    bound = inspect.signature(forward).bind_partial(*args, **kwargs)
    bound.arguments[name] = value
    return bound.args, bound.kwargs


def visible_keys(cp, module: nn.Module, batch: int, local_len: int, position_ids: Optional[torch.Tensor],
                 device: torch.device) -> torch.Tensor:
    """[b, 1, s_local, s] bool: which keys (global order) each of this rank's queries may see."""
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


def _give_mask(cp):
    def hook(module, args, kwargs):
        bound = inspect.signature(module.forward).bind_partial(*args, **kwargs).arguments
        hidden = bound.get("hidden_states", args[0] if args else None)
        position_ids = bound.get("position_ids")
        if not isinstance(position_ids, torch.Tensor):
            position_ids = cp.layer_positions.get("latest")
        mask = visible_keys(cp, module, hidden.size(0), hidden.size(1), position_ids, hidden.device)
        return _with_argument(module.forward, args, kwargs, "attention_mask", mask)
    return hook


def _give_keys(cp):
    keys = GatheredIndexerKeys(cp)

    def hook(indexer, args, kwargs):
        return _with_argument(indexer.forward, args, kwargs, "cache", keys)
    return hook


def apply_indexed_attention(model: nn.Module, cp) -> None:
    """Hooks this rank's indexed-attention modules and their indexers (``refusal`` has passed)."""
    for _, module in _indexed_attention_modules(model):
        if getattr(module, "_torchpp_indexed", False):  # (the recompute pass applies cp again)
            continue
        module.register_forward_pre_hook(_give_mask(cp), with_kwargs=True)
        if module.indexer is not None:
            module.indexer.register_forward_pre_hook(_give_keys(cp), with_kwargs=True)
        module._torchpp_indexed = True


def attend(cp, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           visible: torch.Tensor, indices: Optional[torch.Tensor], scaling: Optional[float],
           sinks: Optional[torch.Tensor]) -> torch.Tensor:
    """This rank's queries [b, h, s_local, d] attending to the keys the indexer chose (global
    indices [b, s_local, k]) among those ``visible`` ([b, 1, s_local, s]); attention sinks (HY-V4)
    add a logit per head to each softmax's denominator. Returns [b, s_local, h, d_v]."""
    if not (isinstance(visible, torch.Tensor) and visible.dtype == torch.bool
            and visible.shape[-2:] == (query.size(2), query.size(2) * cp.size)):
        raise RuntimeError(f"torchpp context parallelism: {type(module).__name__}'s indexed attention was not given "
                           f"the mask of its shard (got {type(visible).__name__} "
                           f"{tuple(getattr(visible, 'shape', ()))})")
    key = unshard_sequence(key, cp.group, dim=2, layout=cp.layout, sum_gradients=True)
    value = unshard_sequence(value, cp.group, dim=2, layout=cp.layout, sum_gradients=True)
    allowed = visible
    if indices is not None:
        chosen = torch.zeros_like(visible).scatter(-1, indices.long().unsqueeze(1), True)
        allowed = visible & chosen
    groups = query.size(1) // key.size(1)
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    if sinks is None:
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=allowed, scale=scaling)
    else:
        scale = scaling if scaling is not None else query.size(-1) ** -0.5
        scores = torch.matmul(query, key.transpose(-1, -2)) * scale
        scores = scores.masked_fill(~allowed, float("-inf"))
        sink = sinks.reshape(1, -1, 1, 1).to(scores.dtype).expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        out = torch.matmul(probs.to(value.dtype), value)
    return out.transpose(1, 2).contiguous()


def defines_indexed_attention(model: nn.Module) -> bool:
    """Whether any config of ``model`` lists indexed-attention layers."""
    from torchpp.context_parallel.hf_support import attention_configs

    return any(LAYER_TYPE in (getattr(c, "layer_types", None) or ()) for c in attention_configs(model).values())


__all__ = ["INDEXERS", "apply_indexed_attention", "attend", "defines_indexed_attention", "refusal", "visible_keys"]
