"""Gated delta-rule layers (Qwen3.5, Qwen3-Next and their kin; Kimi's delta attention) over a
sharded sequence.

The layer's recurrent state S ([d_k, d_v] per head) evolves per token by a map that acts on each
value column alone and is affine in S: over a chunk of the sequence, S_end = M S_start + B, and
each output o_t = o_t(S_start = 0) + P_t S_start. One run per chunk of the model's own delta-rule
function, on values widened by d_k zero columns and an initial state [0, I], yields o(0) and B (the
value columns) with P and M (the identity's columns). The (B, M) of every chunk are all-gathered
(a few d_k x (d_v + d_k) matrices per head; the backward reduce-scatters), each rank composes the
states entering its chunks in sequence order, and adds P_t S_start: the result is the whole
sequence's, to rounding. The short convolution before the rule runs with halos (``halo``).

The model's functions are reached through its modeling module (``causal_conv1d_fn`` and the
chunked rule, ``RULES``): wrapped once there, they shard only inside a wrapped layer's forward (a
context variable set by its hooks) and otherwise call through unchanged.
"""
from __future__ import annotations

import contextvars
import functools
import sys
from typing import TYPE_CHECKING, List, Optional

import torch
from torch import nn

from torchpp.context_parallel import chunk_indices
from torchpp.context_parallel.halo import halos_before, chunk_owner
from torchpp.ops import gather_from_sp_region

if TYPE_CHECKING:
    from torchpp.context_parallel.hf import ContextParallel

# Layer classes by name suffix -> the chunked rule their modeling module calls. Kimi's delta attention
# decays each key channel apart (a diagonal map on the key side): still one map per value column.
RULES = {"GatedDeltaNet": "torch_chunk_gated_delta_rule", "DeltaAttention": "chunk_kimi_delta_attention"}
CONV = "causal_conv1d_fn"
# The cp of the delta-rule layer running now (None: outside one, the functions call through).
_active: contextvars.ContextVar = contextvars.ContextVar("torchpp_cp_delta_rule", default=None)


def delta_rule_of(module: nn.Module) -> Optional[str]:
    """The name of the chunked rule a transformers delta-rule layer calls, where its modeling module
    holds it and the short convolution; else None."""
    name = next((rule for suffix, rule in RULES.items() if type(module).__name__.endswith(suffix)), None)
    modeling = sys.modules.get(type(module).__module__)
    found = name is not None and all(callable(getattr(modeling, f, None)) for f in (name, CONV))
    return name if found else None


def is_delta_rule_layer(module: nn.Module) -> bool:
    return delta_rule_of(module) is not None


def delta_rule_convs(model: nn.Module) -> List[nn.Conv1d]:
    """The short convolutions of the model's delta-rule layers (run with halos)."""
    return [conv for module in model.modules() if is_delta_rule_layer(module)
            for conv in module.children() if isinstance(conv, nn.Conv1d)]


def _pieces(cp: "ContextParallel") -> int:
    return len(chunk_indices(0, cp.size, cp.layout))


def _sharded_conv(original):
    @functools.wraps(original)
    def conv(hidden_states, weight, bias=None, *args, **kwargs):
        cp = _active.get()
        if cp is None:
            return original(hidden_states, weight, bias, *args, **kwargs)
        pieces = list(hidden_states.transpose(1, 2).chunk(_pieces(cp), dim=1))  # [b, n, channels] each
        outs = []
        for piece, before in zip(pieces, halos_before(cp, pieces, weight.shape[-1] - 1)):
            out = original(torch.cat([before, piece], dim=1).transpose(1, 2), weight, bias, *args, **kwargs)
            outs.append(out[..., before.size(1):])
        return torch.cat(outs, dim=-1)
    return conv


def _sharded_rule(original):
    @functools.wraps(original)
    def rule(query, key, value, g, beta, *args, initial_state=None, output_final_state=False, **kwargs):
        cp = _active.get()
        if cp is None:
            return original(query, key, value, g, beta, *args, initial_state=initial_state,
                            output_final_state=output_final_state, **kwargs)
        if initial_state is not None or output_final_state:
            raise NotImplementedError("torchpp context parallelism: a gated delta-rule layer given or asked for a "
                                      "recurrent state (a cache): sharded layers keep none (use_cache=False)")
        return _rule_over_shards(cp, original, query, key, value, g, beta, *args, **kwargs), None
    return rule


def _rule_over_shards(cp: "ContextParallel", rule, query, key, value, g, beta, *args, **kwargs) -> torch.Tensor:
    batch, seq, v_heads, d_v = value.shape
    d_k = key.shape[-1]
    n_pieces = _pieces(cp)
    n = seq // n_pieces
    state_dtype = torch.promote_types(value.dtype, torch.float32)  # the rule's own compute dtype at least
    widened = torch.cat([value, value.new_zeros(batch, seq, v_heads, d_k)], dim=-1)
    identity = torch.eye(d_k, dtype=state_dtype, device=value.device).expand(batch, v_heads, d_k, d_k)
    initial = torch.cat([identity.new_zeros(batch, v_heads, d_k, d_v), identity], dim=-1)
    outs, finals = [], []
    for p in range(n_pieces):
        rows = slice(p * n, (p + 1) * n)
        out, final = rule(query[:, rows], key[:, rows], widened[:, rows], g[:, rows], beta[:, rows], *args,
                          initial_state=initial, output_final_state=True, **kwargs)
        outs.append(out)
        finals.append(final)
    # Every chunk's (B | M), rank-major: [b, c * pieces, v_heads, d_k, d_v + d_k].
    every = gather_from_sp_region(torch.stack(finals, dim=1), cp.group, dim=1)
    results = []
    for out, chunk in zip(outs, chunk_indices(cp.group.rank(), cp.size, cp.layout)):
        # The state entering the chunk, from the sequence's start (an empty sum for the first chunk keeps
        # the gather in every rank's graph: every rank then joins its reduce-scatter in backward).
        state = every.narrow(1, 0, 0).sum(1)[..., :d_v]
        for earlier in range(chunk):
            rank, piece = chunk_owner(earlier, cp.size, cp.layout)
            step = every[:, rank * n_pieces + piece]
            state = step[..., d_v:] @ state + step[..., :d_v]
        carried = torch.einsum("bshk,bhkv->bshv", out[..., d_v:].to(state.dtype), state)
        results.append((out[..., :d_v].to(state.dtype) + carried).to(out.dtype))
    return torch.cat(results, dim=1)


def _wrap_functions(modeling, rule: str = "torch_chunk_gated_delta_rule") -> None:
    if getattr(modeling, "_torchpp_cp_delta_rule", False):
        return
    setattr(modeling, CONV, _sharded_conv(getattr(modeling, CONV)))
    setattr(modeling, rule, _sharded_rule(getattr(modeling, rule)))
    modeling._torchpp_cp_delta_rule = True


def apply_delta_rule(model: nn.Module, cp: "ContextParallel") -> int:
    """Shards each gated delta-rule layer of ``model`` over ``cp``; returns how many."""
    wrapped = 0
    for module in model.modules():
        rule = delta_rule_of(module)
        if rule is None or getattr(module, "_torchpp_delta_rule", False):
            continue
        _wrap_functions(sys.modules[type(module).__module__], rule)
        tokens = {}

        def enter(layer, args, tokens=tokens):
            cp.calls.count += 1  # the layer mixes its sequence through sharded code
            tokens[id(layer)] = _active.set(cp)

        def leave(layer, args, output, tokens=tokens):
            token: Optional[contextvars.Token] = tokens.pop(id(layer), None)
            if token is not None:
                _active.reset(token)

        module.register_forward_pre_hook(enter)
        module.register_forward_hook(leave, always_call=True)
        module._torchpp_delta_rule = True
        wrapped += 1
    return wrapped
