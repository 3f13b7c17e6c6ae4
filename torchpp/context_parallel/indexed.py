"""DeepSeek Sparse Attention (DSA) on a shard of the sequence: a lightweight indexer scores each
query against every key it may see and keeps its top k; attention then runs over those keys alone
(DeepSeek-V3.2, GLM-MoE-DSA, HY-V4, AXK2, Dots3 Note; Qwen4-Exp's QSA, which pools blocks of keys
and hands its choice over as a mask; layers of type ``indexed_attention``).

The keys a query picks may lie anywhere before it, so the keys are gathered once per layer, as in
``mode="all-gather"``: the indexer's keys (it runs without autograd) and the attention's keys and
values (their gradients reduce-scattered back). The model's own indexer runs unchanged:

- the cache it reads its keys from (``cache.update_indexer``) becomes one that hands it every
  rank's keys in sequence order, so its scores and top k are over global key indices;
- its attention module is given this rank's rows of the mask by global position (causal, packed
  rows, windows) instead of the full mask transformers builds on one process;
- transformers hands the top-k indices to any attention backend but eager and SDPA (``indices=``),
  and the cp attention function attends to the chosen keys the mask allows (``attend``); an
  indexer that returns a mask (QSA) has it folded into the mask the function is given;
- an indexer rotating pooled keys at their global positions (QSA) is given the whole sequence's
  rotary tables followed by this rank's.

Top-k ties (the indexer's ReLU zeroes many scores) are broken alike: every row is scored against
the whole sequence in its order, as on one process.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from torchpp.context_parallel import unshard_sequence
from torchpp.context_parallel.families import lookup
from torchpp.context_parallel.gathered import (call_argument, gather_keys, giving_visible_mask, masked_attention,
                                               with_argument)

LAYER_TYPE = "indexed_attention"

# Indexers by modeling module and class, each checked against the unwrapped model in tests. Each
# reads its keys through ``cache.update_indexer``; DeepSeek-V3.2's kind returns the top-k key
# indices [b, s, k], Qwen4-Exp's (QSA) pools blocks of the keys a query sees, rotated at their
# first token's position, and returns the chosen tokens as a mask (``True``: whole position tables).
INDEXERS: Dict[str, bool] = {
    "modeling_deepseek_v32.DeepseekV32Indexer": False,
    "modeling_glm_moe_dsa.GlmMoeDsaIndexer": False,
    "modeling_hy_v4.HYV4Indexer": False,
    "modeling_hy_v4_vl.HYV4VLIndexer": False,
    "modeling_mistral_large4.MistralLarge4TextIndexer": False,
    "modeling_axk2.AXK2Indexer": False,
    "modeling_dots3_note.Dots3NoteTextIndexer": False,
    "modeling_qwen4_exp.Qwen4ExpTextQSAIndexer": True,
}


def _reads_position_tables(indexer: nn.Module) -> Optional[bool]:
    """Whether a known indexer reads rotary tables at keys' positions (None: not a known indexer)."""
    return lookup(indexer, INDEXERS)


def _known(indexer: nn.Module) -> bool:
    return _reads_position_tables(indexer) is not None


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
        return (f"sparse attention whose indexer ({unknown[0]}) is not one whose keys torchpp gathers "
                f"(DeepSeek-V3.2's kind and Qwen4-Exp's are)")
    return ""


class GatheredIndexerKeys:
    """Stands in for the cache an indexer reads its keys from: returns every rank's keys, in order."""

    def __init__(self, cp):
        self.cp = cp

    def update_indexer(self, keys: torch.Tensor, layer_idx: int) -> torch.Tensor:
        return unshard_sequence(keys, self.cp.group, dim=1, layout=self.cp.layout)


def _whole_tables_then_own(cp, tables):
    """Rotary (cos, sin) [b, s_local, d] as [b, s + s_local, d]: the whole sequence's rows, which an
    indexer indexes by global position, then this rank's, which it takes as its queries' (its last
    s_local rows, as it takes them after a cache's)."""
    return tuple(torch.cat([unshard_sequence(t, cp.group, dim=1, layout=cp.layout), t], dim=1) for t in tables)


def _give_keys(cp):
    keys = GatheredIndexerKeys(cp)

    def hook(indexer, args, kwargs):
        args, kwargs = with_argument(indexer.forward, args, kwargs, "cache", keys)
        if _reads_position_tables(indexer):
            tables = call_argument(indexer.forward, args, kwargs, "position_embeddings")
            args, kwargs = with_argument(indexer.forward, args, kwargs, "position_embeddings",
                                         _whole_tables_then_own(cp, tables))
        return args, kwargs
    return hook


def apply_indexed_attention(model: nn.Module, cp) -> None:
    """Hooks this rank's indexed-attention modules and their indexers (``refusal`` has passed)."""
    for _, module in _indexed_attention_modules(model):
        if getattr(module, "_torchpp_indexed", False):  # (the recompute pass applies cp again)
            continue
        module.register_forward_pre_hook(giving_visible_mask(cp), with_kwargs=True)
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
    allowed = visible
    if indices is not None:
        allowed = visible & torch.zeros_like(visible).scatter(-1, indices.long().unsqueeze(1), True)
    return masked_attention(query, gather_keys(cp, key), gather_keys(cp, value), allowed, scaling, sinks)


def defines_indexed_attention(model: nn.Module) -> bool:
    """Whether any config of ``model`` lists indexed-attention layers."""
    from torchpp.context_parallel.hf_support import attention_configs

    return any(LAYER_TYPE in (getattr(c, "layer_types", None) or ()) for c in attention_configs(model).values())


__all__ = ["INDEXERS", "apply_indexed_attention", "attend", "defines_indexed_attention", "refusal"]
