"""Dynamic mask attention on a shard of the sequence (Doge's): each key gets a learned per-head
bias from its value (``dt_proj``), added to every query's score of it, and past
``keep_window_size`` keys each query keeps only the keys of largest bias. The model builds this
mask itself, from the keys it holds and the causal mask it is given.

On a shard, the per-key biases are all-gathered (``dt_proj``'s output, its gradient reduce-scattered
back) and the attention module is given this rank's rows of the causal mask by global position,
so the model's own code builds this rank's rows [b, h, s_local, s] of the mask it builds on one
process, top-k included; the attention function attends over the gathered keys with it.
"""
from __future__ import annotations

from typing import List, Tuple

import torch
from torch import nn

from torchpp.context_parallel.families import named_in
from torchpp.context_parallel.gathered import gather_keys, gathering_output, giving_visible_mask, masked_attention

# Attention modules by modeling module and class whose per-key bias comes from ``dt_proj`` (each
# checked against the unwrapped model in tests).
FAMILIES = ("modeling_doge.DogeAttention",)


def builds_dynamic_mask(module: nn.Module) -> bool:
    return named_in(module, FAMILIES)


def _modules(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    return [(name, module) for name, module in model.named_modules() if builds_dynamic_mask(module)]


def apply_dynamic_masks(model: nn.Module, cp) -> None:
    for _, module in _modules(model):
        if not getattr(module, "_torchpp_dynamic_mask", False):  # (the recompute pass applies cp again)
            module.register_forward_pre_hook(giving_visible_mask(cp), with_kwargs=True)
            module.dt_proj.register_forward_hook(gathering_output(cp))
            module._torchpp_dynamic_mask = True


def attend(cp, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           mask: torch.Tensor, scaling) -> torch.Tensor:
    """This rank's queries [b, h, s_local, d] attending to the gathered keys under the additive mask
    the model built, [b, h, s_local, s] (its own minimum where masked). Returns [b, s_local, h, d_v]."""
    local = query.size(2)
    if not isinstance(mask, torch.Tensor) or mask.shape[-2:] != (local, local * cp.size):
        raise RuntimeError(f"torchpp context parallelism: {type(module).__name__}'s dynamic mask covers "
                           f"{tuple(getattr(mask, 'shape', ()))[-2:]} (queries, keys), not this rank's {local} queries "
                           f"against the sequence's {local * cp.size} keys")
    everything = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=query.device).expand(query.size(0), 1, local, mask.size(-1))
    return masked_attention(query, gather_keys(cp, key), gather_keys(cp, value), everything, scaling, bias=mask)
