"""Griffin's recurrent blocks over a sharded sequence (RecurrentGemma): the short convolution with
halos, then the RG-LRU continued across chunks by the states ``chunk_states`` composes.

The RG-LRU is elementwise, h_t = a_t * h_{t-1} + x_t, with a_t zeroed where a sequence starts
(position 0: packed rows reset there). Each chunk runs the block's own ``_rnn_scan`` from zero;
the chunks' (prod(a), last state) are all-gathered and composed (``diagonal_states``), and
cumprod(a)_t * h_start is added to each output. The scan accumulates in float32 whatever the
model's dtype, so the shards agree with the whole sequence to float32 rounding.
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING, List

import torch
from torch import nn

from torchpp.context_parallel.chunk_states import active, diagonal_states, pieces_of, track_layers
from torchpp.context_parallel.halo import run_with_halos

if TYPE_CHECKING:
    from torchpp.context_parallel.hf import ContextParallel


def is_recurrent_block(module: nn.Module) -> bool:
    """A Griffin recurrent block: a depthwise causal ``conv_1d`` and an ``rg_lru`` with its scan."""
    return isinstance(getattr(module, "conv_1d", None), nn.Conv1d) and \
        callable(getattr(getattr(module, "rg_lru", None), "_rnn_scan", None))


def recurrent_block_convs(model: nn.Module) -> List[nn.Conv1d]:
    return [module.conv_1d for module in model.modules() if is_recurrent_block(module)]


def _conv(forward, hidden_states: torch.Tensor) -> torch.Tensor:
    """The block's nn.Conv1d (padded by k-1 on both sides; the block keeps the first s outputs)."""
    cp = active.get()
    if cp is None:
        return forward(hidden_states)
    pieces = list(hidden_states.transpose(1, 2).chunk(pieces_of(cp), dim=1))  # [b, n, channels] each
    return run_with_halos(cp, [pieces], forward.__self__.kernel_size[0] - 1,
                          lambda extended: forward(extended.transpose(1, 2))[..., :extended.size(1)], out_dim=-1)


def _rnn_scan(scan, hidden_states, recurrent_gate, reset, recurrent_states, acc_dtype=torch.float32):
    cp = active.get()
    if cp is None:
        return scan(hidden_states, recurrent_gate, reset, recurrent_states, acc_dtype)
    if recurrent_states is not None:
        raise NotImplementedError("torchpp context parallelism: an RG-LRU given a recurrent state (a cache): "
                                  "sharded layers keep no state")
    outs, decays, lasts = [], [], []
    for x, a, starts in zip(*(t.chunk(pieces_of(cp), dim=1) for t in (hidden_states, recurrent_gate, reset))):
        out, last = scan(x, a, starts, None, acc_dtype)
        outs.append(out)
        decays.append(torch.cumprod((a * ~starts).to(acc_dtype), dim=1))  # h_start's share of each state
        lasts.append(last)
    states = diagonal_states(cp, [decay[:, -1] for decay in decays], lasts)
    results = [(out.to(acc_dtype) + decay * state[:, None]).to(out.dtype)
               for out, decay, state in zip(outs, decays, states)]
    return torch.cat(results, dim=1), None  # no state kept for a next call


def _prepare(block: nn.Module) -> None:
    block.conv_1d.forward = functools.partial(_conv, block.conv_1d.forward)
    block.rg_lru._rnn_scan = functools.partial(_rnn_scan, block.rg_lru._rnn_scan)


def apply_rg_lru(model: nn.Module, cp: "ContextParallel") -> int:
    """Shards each Griffin recurrent block of ``model`` over ``cp``; returns how many."""
    return track_layers(model, cp, is_recurrent_block, _prepare)
