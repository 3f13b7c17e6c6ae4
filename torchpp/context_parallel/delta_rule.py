"""Gated delta-rule layers over a sharded sequence: Qwen3.5, Qwen3-Next and their kin (one decay
per head) and Kimi's delta attention (one decay per key channel).

The rule's state S ([d_k, d_v] per head) is updated per token by a map on the key side, applied to
each value column alone: the chunk maps of ``chunk_states`` hold. Each chunk runs the model's own
chunked rule on values widened by d_k zero columns from the state [0, I]; ``chunk_states.compose``
does the rest.
"""
from __future__ import annotations

import functools
import sys
from typing import TYPE_CHECKING, List, Optional

import torch
from torch import nn

from torchpp.context_parallel.chunk_states import (CONV, active, check_not_packed, compose, pieces_of, sharded_conv,
                                                   track_layers, widened_initial, wrap_function)

if TYPE_CHECKING:
    from torchpp.context_parallel.hf import ContextParallel

# Layer classes by name suffix -> the chunked rule their modeling module calls.
RULES = {"GatedDeltaNet": "torch_chunk_gated_delta_rule", "DeltaAttention": "chunk_kimi_delta_attention"}


def delta_rule_of(module: nn.Module) -> Optional[str]:
    """The name of the chunked rule a transformers delta-rule layer calls, where its modeling module
    holds it and the short convolution; else None."""
    name = next((rule for suffix, rule in RULES.items() if type(module).__name__.endswith(suffix)), None)
    modeling = sys.modules.get(type(module).__module__)
    found = name is not None and all(callable(getattr(modeling, f, None)) for f in (name, CONV))
    return name if found else None


def is_delta_rule_layer(module: nn.Module) -> bool:
    return delta_rule_of(module) is not None


def defines_delta_rule(modeling) -> bool:
    """Whether a modeling module defines a delta-rule layer we shard (the same answer on every
    pipeline rank, whichever layers it holds)."""
    return callable(getattr(modeling, CONV, None)) and any(
        callable(getattr(modeling, rule, None)) and any(name.endswith(suffix) for name in vars(modeling))
        for suffix, rule in RULES.items())


def delta_rule_convs(model: nn.Module) -> List[nn.Conv1d]:
    """The short convolutions of the model's delta-rule layers (run with halos)."""
    return [conv for module in model.modules() if is_delta_rule_layer(module)
            for conv in module.children() if isinstance(conv, nn.Conv1d)]


def _sharded_rule(original):
    @functools.wraps(original)
    def rule(query, key, value, g, beta, *args, initial_state=None, output_final_state=False, **kwargs):
        cp = active.get()
        if cp is None:
            return original(query, key, value, g, beta, *args, initial_state=initial_state,
                            output_final_state=output_final_state, **kwargs)
        check_not_packed(kwargs, "a gated delta-rule layer")
        if initial_state is not None or output_final_state:
            raise NotImplementedError("torchpp context parallelism: a gated delta-rule layer given or asked for a "
                                      "recurrent state (a cache): sharded layers keep none (use_cache=False)")
        return _rule_over_shards(cp, original, query, key, value, g, beta, *args, **kwargs), None
    return rule


def _rule_over_shards(cp: "ContextParallel", rule, query, key, value, g, beta, *args, **kwargs) -> torch.Tensor:
    batch, seq, v_heads, d_v = value.shape
    d_k = key.shape[-1]
    n = seq // pieces_of(cp)
    state_dtype = torch.promote_types(value.dtype, torch.float32)  # the rule's own compute dtype at least
    widened = torch.cat([value, value.new_zeros(batch, seq, v_heads, d_k)], dim=-1)
    initial = widened_initial(batch, v_heads, d_k, d_v, state_dtype, value.device)
    outs, finals = [], []
    for start in range(0, seq, n):
        rows = slice(start, start + n)
        out, final = rule(query[:, rows], key[:, rows], widened[:, rows], g[:, rows], beta[:, rows], *args,
                          initial_state=initial, output_final_state=True, **kwargs)
        outs.append(out)
        finals.append(final)
    return compose(cp, outs, finals, d_v)


def wrap_modeling(modeling, rule: str = "torch_chunk_gated_delta_rule") -> None:
    """Wraps a modeling module's short convolution and chunked rule (they call through outside a
    sharded layer)."""
    wrap_function(modeling, CONV, sharded_conv)
    wrap_function(modeling, rule, _sharded_rule)


def _prepare(module: nn.Module) -> None:
    wrap_modeling(sys.modules[type(module).__module__], delta_rule_of(module))


def apply_delta_rule(model: nn.Module, cp: "ContextParallel") -> int:
    """Shards each delta-rule layer of ``model`` over ``cp``; returns how many."""
    return track_layers(model, cp, is_delta_rule_layer, _prepare)
