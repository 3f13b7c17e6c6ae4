"""RWKV's time mixing over a sharded sequence (RWKV-4, ``RwkvSelfAttention``): its token shift with
a halo of one token, and its WKV recurrence continued across chunks.

Per channel, WKV keeps a numerator and a denominator, each decayed by exp(w) per token (w =
-exp(time_decay)) and added exp(k_t) v_t and exp(k_t); its output is their ratio with the current
token weighted by exp(time_first). Over a chunk of n tokens the state map is diagonal,
S_end = exp(n w) S_start + S_end(0), but the output is a ratio, not affine in S_start: each chunk
runs the model's own recurrence twice, from zero for its last state (the chunks' states are
all-gathered and composed in sequence order, as ``chunk_states`` does), then from the state
entering it for its outputs. States are kept as transformers keeps them, (num, den, max) with the
real values num * exp(max), so composing never overflows. The model's CPU recurrence runs on every
device (the CUDA kernel returns no gradient for a given state).
"""
from __future__ import annotations

import functools
import sys
from typing import TYPE_CHECKING, List

import torch
from torch import nn

from torchpp.context_parallel.chunk_states import entering_states, pieces_of
from torchpp.context_parallel.halo import run_with_halos

if TYPE_CHECKING:
    from torchpp.context_parallel.hf import ContextParallel

RECURRENCE = "rwkv_linear_attention_cpu"
NO_STATE = -1e38  # (the model's own max for an empty state: exp(num) of it is 0)


def defines_rwkv(modeling) -> bool:
    return callable(getattr(modeling, RECURRENCE, None))


def is_time_mixing(module: nn.Module) -> bool:
    """An RWKV time-mixing module: its decay, bonus and token-shift mixing, in a modeling module
    holding the recurrence."""
    return all(hasattr(module, attr) for attr in ("time_decay", "time_first", "time_shift", "extract_key_value")) \
        and defines_rwkv(sys.modules.get(type(module).__module__))


def _then(step: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """A chunk's map (num, den, max of its state from zero; n w) applied to the state before it."""
    decayed, own = state[..., 2] + step[..., 3], step[..., 2]
    top = torch.maximum(decayed, own)
    before, mine = torch.exp(decayed - top), torch.exp(own - top)
    return torch.stack([before * state[..., 0] + mine * step[..., 0],
                        before * state[..., 1] + mine * step[..., 1], top], dim=-1)


def _empty(zeros: torch.Tensor) -> torch.Tensor:
    return torch.stack([zeros[..., 0], zeros[..., 1], zeros[..., 2] + NO_STATE], dim=-1)


def _sharded_forward(module: nn.Module, cp: "ContextParallel", hidden, state=None, use_cache=False):
    if state is not None or use_cache:
        raise NotImplementedError("torchpp context parallelism: RWKV's time mixing was given a state or asked to keep "
                                  "one (a cache): sharded layers keep no state (use_cache=False)")
    cp.calls.made()  # the layer mixes its sequence through sharded code
    recurrence = getattr(sys.modules[type(module).__module__], RECURRENCE)
    n_pieces = pieces_of(cp)
    # The token shift reads the token before each: a halo of one.
    receptance, key, value = run_with_halos(cp, [list(hidden.chunk(n_pieces, dim=1))], 1,
                                            lambda extended: module.extract_key_value(extended)[:3], out_dim=1)
    keys, values = key.chunk(n_pieces, dim=1), value.chunk(n_pieces, dim=1)
    maps: List[torch.Tensor] = []
    for k, v in zip(keys, values):
        _, (num, den, top) = recurrence(module.time_decay, module.time_first, k, v, return_state=True)
        decay = (-torch.exp(module.time_decay) * k.size(1)).to(top.dtype).expand_as(top)
        maps.append(torch.stack([num.to(top.dtype), den.to(top.dtype), top, decay], dim=-1))
    states = entering_states(cp, maps, _then, _empty)
    outs = [recurrence(module.time_decay, module.time_first, k, v, state=list(entering.unbind(-1)))[0]
            for k, v, entering in zip(keys, values, states)]
    return module.output(receptance * torch.cat(outs, dim=1)), None


def apply_rwkv(model: nn.Module, cp: "ContextParallel") -> int:
    """Shards each RWKV time-mixing module of ``model`` over ``cp``; returns how many."""
    done = 0
    for module in model.modules():
        if is_time_mixing(module) and not getattr(module, "_torchpp_rwkv", False):  # (recompute applies cp again)
            module.forward = functools.partial(_sharded_forward, module, cp)
            module._torchpp_rwkv = True
            done += 1
    return done
