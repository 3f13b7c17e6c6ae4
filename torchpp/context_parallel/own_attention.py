"""Attention written in a model's own code instead of through transformers' attention functions,
routed to sharded attention family by family: the module keeps its projections, rotary tables,
head splits and output projection, and only the softmax over the keys becomes the cp attention
function (``hf._attention``: masks by global position, packed rows, refusals).

- GPT-Neo (``GPTNeoSelfAttention._attn``): unscaled scores, local layers a causal window of
  ``config.window_size``; its scores are computed in float32 whatever the model's dtype.
- Falcon with rotary positions (``FalconAttention.forward``): multi-query, grouped and the new
  decoder architecture's heads; Falcon with ALiBi (``config.alibi``) is refused.
"""
from __future__ import annotations

import sys
from typing import Callable, Dict, List, Tuple

from torch import nn


# Each adapter calls module._torchpp_cp_attention (set by apply_own_attention: the plain or the
# recomputing attention function, as the recompute pass chooses on its second application).


def _gpt_neo(module: nn.Module) -> None:
    window = module.config.window_size if module.attention_type == "local" else None

    def _attn(query, key, value, attention_mask=None):
        out, _ = module._torchpp_cp_attention(module, query, key, value, attention_mask, scaling=1.0,
                                               sliding_window=window)
        return out.transpose(1, 2), None  # back to [b, heads, s, d], as _merge_heads takes it
    module._attn = _attn


def _falcon(module: nn.Module) -> None:
    rotary = sys.modules[type(module).__module__].apply_rotary_pos_emb

    def forward(hidden_states, alibi, attention_mask, position_ids=None, layer_past=None, use_cache=False,
                output_attentions=False, position_embeddings=None, **kwargs):
        query, key, value = module._split_heads(module.query_key_value(hidden_states))
        batch, length = query.shape[:2]
        kv_heads = module.num_heads if module.new_decoder_architecture else module.num_kv_heads
        query, key, value = (t.transpose(1, 2).reshape(batch, heads, length, module.head_dim)
                             for t, heads in ((query, module.num_heads), (key, kv_heads), (value, kv_heads)))
        query, key = rotary(query, key, *position_embeddings)
        out, _ = module._torchpp_cp_attention(module, query, key, value, attention_mask, position_ids=position_ids)
        return module.dense(out.reshape(batch, length, module.num_heads * module.head_dim)), None
    module.forward = forward


# Attention classes by name -> how their softmax is routed (flash variants subclass them).
ADAPTERS: Dict[str, Callable[[nn.Module], None]] = {
    "GPTNeoSelfAttention": _gpt_neo,
    "FalconAttention": _falcon,
}


def _adapter(module: nn.Module):
    for cls in type(module).__mro__:
        if cls.__name__ in ADAPTERS:
            return ADAPTERS[cls.__name__]
    return None


def own_attention_modules(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """(path, module) of the attention modules of ``model`` that ``apply_own_attention`` routes."""
    return [(name, module) for name, module in model.named_modules() if _adapter(module) is not None]


def refusal(model: nn.Module) -> str:
    """Why a model with routed attention still cannot be served ('' when it can)."""
    if getattr(model.config, "alibi", False) and own_attention_modules(model):
        return "uses ALiBi (config.alibi), whose position bias sharded attention does not implement"
    return ""


def apply_own_attention(model: nn.Module, attention: Callable) -> None:
    """Routes each such module's softmax through ``attention`` (transformers' attention-function
    interface; the cp one)."""
    for _, module in own_attention_modules(model):
        if not hasattr(module, "_torchpp_cp_attention"):
            _adapter(module)(module)
        module._torchpp_cp_attention = attention
