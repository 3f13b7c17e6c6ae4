"""Linear recurrences over a sharded sequence: what the delta rule (``delta_rule``), Mamba-2's
state-space scan (``mamba``), Mamba-1's selective scan (``selective_scan``) and the RG-LRU
(``rg_lru``) share. The last two are elementwise in their state, so their chunk maps are diagonal
(``diagonal_states``); the first two are described here.

Both layers keep a state S ([d_k, d_v] per head, written key-major) that each token updates by a
map acting on each value column alone and affine in S: over a chunk of the sequence S_end =
M S_start + B, and each output o_t = o_t(S_start = 0) + P_t S_start. One run per chunk of the
model's own chunked function, on values widened by d_k zero columns from the initial state [0, I],
yields o(0) and B (the value columns) with P and M (the identity's columns). ``compose`` then
all-gathers every chunk's (B, M) (d_k x (d_v + d_k) per head and chunk, whatever the length; the
backward reduce-scatters), composes the states entering this rank's chunks in sequence order and
adds P_t S_start: the whole sequence's result, to rounding.

The models' functions are reached through their modeling modules: wrapped once there
(``wrap_function``), they shard only inside a layer ``track_layers`` hooks (a context variable
names its cp) and otherwise call through unchanged. The short convolution before the scan runs
with halos (``halo``).
"""
from __future__ import annotations

import contextvars
import functools
import sys
from typing import TYPE_CHECKING, Callable, List, Optional

import torch
from torch import nn

from torchpp.context_parallel import chunk_indices
from torchpp.context_parallel.halo import chunk_owner, run_with_halos
from torchpp.ops import gather_from_sp_region

if TYPE_CHECKING:
    from torchpp.context_parallel.hf import ContextParallel

CONV = "causal_conv1d_fn"
# The cp of the sharded recurrent layer running now (None: outside one, the functions call through).
active: contextvars.ContextVar = contextvars.ContextVar("torchpp_cp_recurrence", default=None)


# Keywords that describe packed sequences by offsets into the whole sequence (flash-style kernels'):
# a chunk's run cannot use them, and ignoring them would mix the packed sequences.
PACKED_KEYWORDS = ("cu_seqlens", "seq_idx", "cu_seq_lens_q", "cu_seq_lens_k")


def check_not_packed(kwargs, what: str) -> None:
    given = sorted(name for name in PACKED_KEYWORDS if kwargs.get(name) is not None)
    if given:
        raise NotImplementedError(f"torchpp context parallelism: {what} was given {', '.join(given)} (packed sequences "
                                  f"by offsets into the whole sequence), which a shard of the sequence cannot use; "
                                  f"pack by position ids instead")


def pieces_of(cp: "ContextParallel") -> int:
    return len(chunk_indices(0, cp.size, cp.layout))


def widened_initial(batch: int, heads: int, d_k: int, d_v: int, dtype: torch.dtype, device) -> torch.Tensor:
    """[0 | I]: [b, heads, d_k, d_v + d_k], the state whose identity columns record the chunk's map."""
    identity = torch.eye(d_k, dtype=dtype, device=device).expand(batch, heads, d_k, d_k)
    return torch.cat([identity.new_zeros(batch, heads, d_k, d_v), identity], dim=-1)


def entering_states(cp: "ContextParallel", maps: List[torch.Tensor], then: Callable, zero: Callable) -> List[torch.Tensor]:
    """The state entering each of this rank's chunks, from its chunks' maps (one per piece in shard
    order, all alike in shape): all-gathered (the backward reduce-scatters), then composed from the
    sequence's start in sequence order, ``then(map, state)`` applying a chunk's map to the state
    before it and ``zero(map-shaped zeros)`` the state entering the first chunk."""
    n_pieces = len(maps)
    every = gather_from_sp_region(torch.stack(maps, dim=1), cp.group, dim=1)  # rank-major chunk maps
    states = []
    for chunk in chunk_indices(cp.group.rank(), cp.size, cp.layout):
        # An empty sum for the first chunk keeps the gather in every rank's graph: every rank then
        # joins its reduce-scatter in backward.
        state = zero(every.narrow(1, 0, 0).sum(1))
        for earlier in range(chunk):
            rank, piece = chunk_owner(earlier, cp.size, cp.layout)
            state = then(every[:, rank * n_pieces + piece], state)
        states.append(state)
    return states


def diagonal_states(cp: "ContextParallel", totals: List[torch.Tensor], lasts: List[torch.Tensor]) -> List[torch.Tensor]:
    """The states entering this rank's chunks of an elementwise recurrence h_t = a_t * h_{t-1} + u_t
    (Mamba-1's selective scan, the RG-LRU), from each chunk's total decay prod(a) and its last state
    run from zero: h_end = prod(a) * h_start + last."""
    maps = [torch.stack([total, last.to(total.dtype)], dim=-1) for total, last in zip(totals, lasts)]
    return entering_states(cp, maps, lambda step, state: step[..., 0] * state + step[..., 1],
                           lambda zeros: zeros[..., 0])


def compose(cp: "ContextParallel", outs: List[torch.Tensor], finals: List[torch.Tensor], d_v: int) -> torch.Tensor:
    """This rank's outputs from its chunks' widened runs: outs [b, n, heads, d_v + d_k] (o(0) | P) and
    finals [b, heads, d_k, d_v + d_k] (B | M), one per piece in shard order; returns [b, s_local, heads, d_v]."""
    states = entering_states(cp, finals, lambda step, state: step[..., d_v:] @ state + step[..., :d_v],
                             lambda zeros: zeros[..., :d_v])
    results = []
    for out, state in zip(outs, states):
        carried = torch.einsum("bshk,bhkv->bshv", out[..., d_v:].to(state.dtype), state)
        results.append((out[..., :d_v].to(state.dtype) + carried).to(out.dtype))
    return torch.cat(results, dim=1)


def sharded_conv(original: Callable) -> Callable:
    """A causal_conv1d_fn ([b, channels, s] in) that, inside a sharded layer, runs each chunk with halos."""
    @functools.wraps(original)
    def conv(hidden_states, weight, bias=None, *args, **kwargs):
        cp = active.get()
        if cp is None:
            return original(hidden_states, weight, bias, *args, **kwargs)
        check_not_packed(kwargs, "a short convolution")
        pieces = list(hidden_states.transpose(1, 2).chunk(pieces_of(cp), dim=1))  # [b, n, channels] each
        return run_with_halos(cp, [pieces], weight.shape[-1] - 1,
                              lambda extended: original(extended.transpose(1, 2), weight, bias, *args, **kwargs),
                              out_dim=-1)
    return conv


def declined(original: Callable) -> Callable:
    """A fused kernel path declined inside a sharded layer: None is the layers' own signal to take
    the unfused path (their torch fallbacks return None too)."""
    @functools.wraps(original)
    def fused(*args, **kwargs):
        return None if active.get() is not None else original(*args, **kwargs)
    return fused


def wrap_function(modeling, name: str, wrapper: Callable[[Callable], Callable]) -> None:
    """modeling.name = wrapper(modeling.name), once per modeling module and name."""
    done = modeling.__dict__.setdefault("_torchpp_cp_wrapped", set())
    if name not in done:
        setattr(modeling, name, wrapper(getattr(modeling, name)))
        done.add(name)


def wrap_scan_modeling(modeling, scan: str, sharded_scan: Callable, fused: str) -> None:
    """Wraps a Mamba modeling module's short convolution, scan and fused kernel path (they call
    through outside a sharded layer)."""
    wrap_function(modeling, CONV, sharded_conv)
    wrap_function(modeling, scan, sharded_scan)
    if callable(getattr(modeling, fused, None)):  # (Zamba's modeling has no fused path)
        wrap_function(modeling, fused, declined)


def track_mixers(model: nn.Module, cp: "ContextParallel", is_mixer: Callable[[nn.Module], bool],
                 wrap_modeling: Callable) -> int:
    """``track_layers`` for mixers whose functions live in their modeling module (wrapped first)."""
    return track_layers(model, cp, is_mixer, lambda module: wrap_modeling(sys.modules[type(module).__module__]))


def track_layers(model: nn.Module, cp: "ContextParallel", is_layer: Callable[[nn.Module], bool],
                 prepare: Callable[[nn.Module], None]) -> int:
    """Hooks each layer ``is_layer`` accepts so that the wrapped functions shard while it runs
    (``prepare`` wraps its modeling module's functions first); returns how many."""
    tracked = 0
    for module in model.modules():
        if not is_layer(module) or getattr(module, "_torchpp_recurrence", False):  # (recompute applies cp again)
            continue
        prepare(module)
        tokens = []

        def enter(layer, args, tokens=tokens):
            cp.calls.made()  # the layer mixes its sequence through sharded code
            tokens.append(active.set(cp))

        def leave(layer, args, output, tokens=tokens):
            token: Optional[contextvars.Token] = tokens.pop() if tokens else None
            if token is not None:
                active.reset(token)

        module.register_forward_pre_hook(enter)
        module.register_forward_hook(leave, always_call=True)
        module._torchpp_recurrence = True
        tracked += 1
    return tracked
