"""Mamba-1 mixers over a sharded sequence (Mamba, Falcon-Mamba, Jamba, Zamba): transformers'
``mamba_selective_scan`` run per chunk, continued across chunks by the states ``chunk_states``
composes.

The selective scan keeps a state h[d, n] per channel d that each token updates elementwise:
h_t = exp(dt_t A) * h_{t-1} + dt_t B_t x_t, y_t = C_t . h_t (then + D x_t, times silu(z_t)). A
chunk's map is therefore diagonal: h_end = exp(A sum(dt)) * h_start + h_end(0), and the state
entering a chunk adds C_t . (exp(A cumsum(dt)_t) * h_start) to each output. Each chunk runs the
model's own scan from zero (returning its last state), the chunks' (decay, h_end(0)) are all-gathered
and composed, and the carried term is added before the D skip and the gate, which the scan would
otherwise apply first. The fused kernel path (``mamba_inner_fn``, taken when mamba_ssm is installed)
is declined under cp; the short convolution runs with halos.
"""
from __future__ import annotations

import functools
import sys
from typing import TYPE_CHECKING, List

import torch
import torch.nn.functional as F
from torch import nn

from torchpp.context_parallel.chunk_states import (CONV, active, check_not_packed, diagonal_states, pieces_of,
                                                   track_mixers, wrap_scan_modeling)

if TYPE_CHECKING:
    from torchpp.context_parallel.hf import ContextParallel

SCAN = "mamba_selective_scan"
FUSED = "mamba_inner_fn"


def defines_selective_scan(modeling) -> bool:
    """Whether a modeling module holds the functions a Mamba-1 mixer we shard calls (the fused path,
    where there is one, is declined)."""
    return all(callable(getattr(modeling, name, None)) for name in (SCAN, CONV))


def is_selective_scan_mixer(module: nn.Module) -> bool:
    """A transformers Mamba-1 mixer (A_log, D, the dt and x projections as modules or, in Zamba's
    multi-head mixer, as weights per head, a short conv1d) whose modeling module holds the scan and
    the convolution we shard."""
    if not all(hasattr(module, attr) for attr in ("A_log", "D", "conv1d")) or \
            not any(hasattr(module, attr) for attr in ("dt_proj", "dt_proj_weight")) or \
            not any(hasattr(module, attr) for attr in ("x_proj", "x_proj_weight")):
        return False
    return defines_selective_scan(sys.modules.get(type(module).__module__))


def selective_scan_convs(model: nn.Module) -> List[nn.Conv1d]:
    return [module.conv1d for module in model.modules() if is_selective_scan_mixer(module)]


def _sharded_scan(original):
    @functools.wraps(original)
    def scan(hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
             return_last_state=False, **kwargs):
        cp = active.get()
        if cp is None:
            return original(hidden_states, dt, A, B, C, D=D, z=z, delta_bias=delta_bias,
                            delta_softplus=delta_softplus, return_last_state=return_last_state, **kwargs)
        check_not_packed(kwargs, "a selective scan")
        if return_last_state:
            raise NotImplementedError("torchpp context parallelism: a selective scan asked for its last state (a "
                                      "cache): sharded layers keep no state")
        return _scan_over_shards(cp, original, hidden_states, dt, A, B, C, D, z, delta_bias, delta_softplus, kwargs)
    return scan


def _time_steps(dt: torch.Tensor, delta_bias, softplus: bool) -> torch.Tensor:
    """dt as the scan discretizes with it (bias added, then softplus)."""
    if delta_bias is not None:
        dt = dt + delta_bias.to(dt.dtype)[..., None]
    return F.softplus(dt) if softplus else dt


def _scan_over_shards(cp: "ContextParallel", scan, x, dt, A, B, C, D, z, delta_bias, softplus, kwargs) -> torch.Tensor:
    """x, dt, z [b, d, s_local], B and C [b, n, s_local] (this rank's pieces in shard order); A [d, n]."""
    length = x.shape[-1] // pieces_of(cp)
    pieces = [slice(start, start + length) for start in range(0, x.shape[-1], length)]
    outs, decays, lasts = [], [], []
    for cols in pieces:
        out, last = scan(x[..., cols], dt[..., cols], A, B[..., cols], C[..., cols], delta_bias=delta_bias,
                         delta_softplus=softplus, return_last_state=True, **kwargs)
        steps = _time_steps(dt[..., cols], delta_bias, softplus)
        decay = torch.exp(A[None, :, None, :] * steps.cumsum(-1)[..., None])  # [b, d, t, n]: h_start's share of h_t
        outs.append(out)
        decays.append(decay)
        lasts.append(last)
    states = diagonal_states(cp, [decay[:, :, -1] for decay in decays], lasts)
    results = []
    for out, decay, state, cols in zip(outs, decays, states, pieces):
        carried = torch.einsum("bdtn,bnt,bdn->bdt", decay, C[..., cols].to(decay.dtype), state)
        results.append((out.to(carried.dtype) + carried).to(out.dtype))
    y = torch.cat(results, dim=-1)
    if D is not None:  # as the scan applies them, after the state's contribution
        y = y + x * D[None, :, None]
    return y * F.silu(z) if z is not None else y


def wrap_modeling(modeling) -> None:
    wrap_scan_modeling(modeling, SCAN, _sharded_scan, FUSED)


def apply_selective_scan(model: nn.Module, cp: "ContextParallel") -> int:
    """Shards each Mamba-1 mixer of ``model`` over ``cp``; returns how many."""
    return track_mixers(model, cp, is_selective_scan_mixer, wrap_modeling)
