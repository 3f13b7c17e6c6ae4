"""Relative position biases on a shard of the sequence (Inkling's, Inkling 2's): each token mixes a
trained bank of bias-vs-distance profiles into one bias per backward distance, zero outside
``0 <= distance < rel_extent``, added to its scores before the softmax.

The bias module is handed distances by global position (this rank's queries against the whole
sequence's keys) instead of the shard's own, so it returns this rank's rows [b, h, s_local, s] of the
bias the unwrapped model adds; the attention function then attends over the gathered keys with it
(``gathered.masked_attention``; Inkling 2's per-token sinks too). The bias is as large as the rows of
scores it biases: the memory of these layers is the one of written-out scores, 1/cp of one process's.
"""
from __future__ import annotations

import inspect
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from torchpp.context_parallel.families import lookup
from torchpp.context_parallel.gathered import call_argument, gather_keys, masked_attention, visible_keys, with_argument

# Bias modules by modeling module and class: how each is told the distances (each checked against the
# unwrapped model in tests). "positions": (relative_states, query_positions, key_positions);
# "distance": (hidden_states, relative_distance [s_q, s_k], position_ids).
BIASES: Dict[str, str] = {
    "modeling_inkling.InklingRelativeLogits": "positions",
    "modeling_inkling2.Inkling2RelativePositionBias": "distance",
    "modeling_inkling2_loop.Inkling2LoopRelativePositionBias": "distance",
}


def _kind(module: nn.Module) -> Optional[str]:
    return lookup(module, BIASES)


def _bias_modules(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    return [(name, module) for name, module in model.named_modules() if _kind(module) is not None]


def refusal(model: nn.Module) -> str:
    """Why a model with relative position biases cannot run them on a shard ('' when it can)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if any(_kind(m) == "positions" for _, m in _bias_modules(model)) \
            and getattr(config, "log_scaling_n_floor", None) is not None:
        return ("scales its full-attention queries and biases by log(position), positions it counts from 0 on its "
                "input in its own code, which on a shard would start again at 0")
    return ""


def _global_distances(cp):
    def hook(module, args, kwargs):
        first = next(iter(inspect.signature(module.forward).parameters))  # ([b, s_local, ...] states)
        states = call_argument(module.forward, args, kwargs, first)
        local = states.size(1)
        queries = cp.positions(local * cp.size, states.device)
        keys = torch.arange(local * cp.size, device=states.device)
        if _kind(module) == "positions":
            args, kwargs = with_argument(module.forward, args, kwargs, "query_positions", queries)
            return with_argument(module.forward, args, kwargs, "key_positions", keys)
        return with_argument(module.forward, args, kwargs, "relative_distance", queries[:, None] - keys[None, :])
    return hook


def apply_relative_biases(model: nn.Module, cp) -> None:
    """Hands this rank's bias modules distances by global position (``refusal`` has passed)."""
    for _, module in _bias_modules(model):
        if not getattr(module, "_torchpp_global_distances", False):  # (the recompute pass applies cp again)
            module.register_forward_pre_hook(_global_distances(cp), with_kwargs=True)
            module._torchpp_global_distances = True


def attend(cp, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           attention_mask: Optional[torch.Tensor], position_bias: torch.Tensor, scaling: Optional[float],
           sinks: Optional[torch.Tensor], position_ids: Optional[torch.Tensor]) -> torch.Tensor:
    """This rank's queries [b, h, s_local, d] attending to the gathered keys (causal, its window,
    its packed row) with the bias [b, h, s_local, s] added. Returns [b, s_local, h, d_v]."""
    from torchpp.context_parallel.hf_support import check_call

    check_call(module, query, key, attention_mask, 0.0, None, True, {})  # (a mask of the model's own: refused)
    local = query.size(2)
    if position_bias.shape[-2:] != (local, local * cp.size):
        raise RuntimeError(f"torchpp context parallelism: {type(module).__name__}'s position bias covers "
                           f"{tuple(position_bias.shape[-2:])} (queries, keys), not this rank's {local} queries against "
                           f"the sequence's {local * cp.size} keys: its bias module was not given global distances")
    visible = visible_keys(cp, module, query.size(0), local, position_ids, query.device)
    return masked_attention(query, gather_keys(cp, key), gather_keys(cp, value), visible, scaling, sinks,
                            bias=position_bias)
