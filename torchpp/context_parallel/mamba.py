"""Mamba-2 mixers over a sharded sequence (Mamba-2, Nemotron-H, Bamba, Falcon-H1, Granite 4
hybrids, Zamba2): transformers' ``mamba2_chunk_scan`` with the chunk maps of ``chunk_states``.

The scan's state is [head_dim, d_state] per head: h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T, y_t =
h_t C_t + D x_t. Each row (one channel of x) evolves alone, so the rows play the value columns of
``chunk_states`` and d_state the key side: a chunk runs on x widened by d_state zero channels from
the state [0; I], and its final state, transposed, is the (B | M) ``compose`` takes. The D skip
term is per token and vanishes on the zero channels; the gate is applied after the scan (z=None
in every caller). Under cp the fused kernel path (``mamba2_split_conv1d_scan_combined``, taken
when mamba_ssm is installed) is declined, so the layer runs the scan and convolution we shard.
"""
from __future__ import annotations

import functools
import sys
from typing import TYPE_CHECKING, List

import torch
from torch import nn

from torchpp.context_parallel.chunk_states import (CONV, active, check_not_packed, compose, pieces_of, track_mixers,
                                                   widened_initial, wrap_scan_modeling)

if TYPE_CHECKING:
    from torchpp.context_parallel.hf import ContextParallel

SCAN = "mamba2_chunk_scan"
FUSED = "mamba2_split_conv1d_scan_combined"


def is_mamba2_mixer(module: nn.Module) -> bool:
    """A transformers Mamba-2 mixer (A_log, dt_bias, a short conv1d) whose modeling module holds the
    chunked scan and the convolution we shard."""
    if not all(hasattr(module, attr) for attr in ("A_log", "dt_bias", "conv1d")):
        return False
    return defines_mamba2(sys.modules.get(type(module).__module__))


def defines_mamba2(modeling) -> bool:
    """Whether a modeling module holds the functions a Mamba-2 mixer we shard calls."""
    return all(callable(getattr(modeling, name, None)) for name in (SCAN, CONV, FUSED))


def mamba2_convs(model: nn.Module) -> List[nn.Conv1d]:
    return [module.conv1d for module in model.modules() if is_mamba2_mixer(module)]


def _sharded_scan(original):
    @functools.wraps(original)
    def scan(hidden_states, dt, A, B, C, chunk_size, *args, initial_states=None, return_final_states=False,
             z=None, **kwargs):
        cp = active.get()
        if cp is None:
            return original(hidden_states, dt, A, B, C, chunk_size, *args, initial_states=initial_states,
                            return_final_states=return_final_states, z=z, **kwargs)
        check_not_packed(kwargs, "a Mamba-2 scan")
        if initial_states is not None or return_final_states or z is not None:
            raise NotImplementedError("torchpp context parallelism: a Mamba-2 scan given or asked for a recurrent "
                                      "state (a cache), or gated inside the scan: sharded layers keep no state and "
                                      "take the gate after the scan")
        return _scan_over_shards(cp, original, hidden_states, dt, A, B, C, chunk_size, *args, **kwargs)
    return scan


def _scan_over_shards(cp: "ContextParallel", scan, x, dt, A, B, C, chunk_size, *args, **kwargs) -> torch.Tensor:
    batch, seq, heads, head_dim = x.shape
    d_state = B.shape[-1]
    n = seq // pieces_of(cp)
    state_dtype = torch.promote_types(x.dtype, torch.float32)  # the scan computes in float32 at least
    widened = torch.cat([x, x.new_zeros(batch, seq, heads, d_state)], dim=-1)
    # Rows [0; I] of the value-major state: the transpose of chunk_states' key-major [0 | I].
    initial = widened_initial(batch, heads, d_state, head_dim, state_dtype, x.device).transpose(-1, -2)
    outs, finals = [], []
    for start in range(0, seq, n):
        rows = slice(start, start + n)
        out, final = scan(widened[:, rows], dt[:, rows], A, B[:, rows], C[:, rows], chunk_size, *args,
                          initial_states=initial, return_final_states=True, **kwargs)
        outs.append(out)
        finals.append(final.transpose(-1, -2))  # [b, h, d_state, head_dim + d_state]: (B | M) key-major
    return compose(cp, outs, finals, head_dim)


def wrap_modeling(modeling) -> None:
    wrap_scan_modeling(modeling, SCAN, _sharded_scan, FUSED)


def apply_mamba2(model: nn.Module, cp: "ContextParallel") -> int:
    """Shards each Mamba-2 mixer of ``model`` over ``cp``; returns how many."""
    return track_mixers(model, cp, is_mamba2_mixer, wrap_modeling)
