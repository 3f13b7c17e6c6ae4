"""Short causal convolutions over a sharded sequence (LFM2's gated short convolutions, Inkling's
short convolutions, static or with per-token taps).

A causal convolution of kernel k reads, for each token, the k-1 tokens before it, which for the
first tokens of a chunk live on another rank (zigzag: rank r's chunks r and 2c-1-r follow chunks
held by ranks r-1 and r+1). Each rank all-gathers the last min(k-1, n) tokens of each of its
chunks (n tokens each; a few tokens per rank, whatever the sequence length), and runs the mixer
once per chunk on those k-1 tokens before it followed by the chunk, keeping the chunk's outputs.
At the start of the sequence fewer tokens precede the chunk, and the mixer's own zero padding
applies, as on the whole sequence. The gather's backward reduce-scatters, so the neighbours'
tokens get their gradient.

Only mixers known to be per token except for causal convolutions are served (``HALO_MIXERS``):
running them on the tokens they reach back (k-1 for one kernel of k) is then exact for the chunk's
tokens.
Their inputs along the sequence (``SEQUENCE_INPUTS``: the hidden states, and the input Inkling 2's
per-token taps are projected from) are extended alike.
"""
from __future__ import annotations

import functools
import inspect
import math
from typing import TYPE_CHECKING, List, Optional, Tuple

import torch
from torch import nn

from torchpp.context_parallel import chunk_indices
from torchpp.ops import gather_from_sp_region

if TYPE_CHECKING:
    from torchpp.context_parallel.hf import ContextParallel

# Mixer classes whose forward is per token but for causal convolutions over the sequence: the
# attributes holding their nn.Conv1d (stacked ones reach back the sum of their kernels less one),
# or none where the taps are computed per token (Inkling 2's dynamic convolutions, whose kernel is
# ``conv_kernel_size``).
HALO_MIXERS = {"Lfm2ShortConv": ("conv",), "Lfm2MoeShortConv": ("conv",), "Lfm3ShortConv": ("conv",),
               "InklingShortConvolution": ("conv1d",), "Inkling2ShortConvolution": ("conv1d",),
               "Inkling2LoopShortConvolution": ("conv1d",), "Inkling2DynamicShortConvolution": (),
               "Inkling2LoopDynamicShortConvolution": (),
               # ZAYA's compressed convolutional attention projection: a depthwise then a grouped causal
               # convolution over its queries and keys, and half of each value head from the token before.
               "ZayaCCAProjection": ("conv_qk_depthwise", "conv_qk_grouped"),
               # RWKV's channel mixing: each token mixed with the one before (its time shift).
               "RwkvFeedForward": ()}
# Tokens back a mixer reads besides its convolutions (ZAYA's delayed value half, RWKV's time shift).
EXTRA_REACH = {"ZayaCCAProjection": 1, "RwkvFeedForward": 1}
SEQUENCE_INPUTS = ("hidden_states", "dynamic_input", "hidden")


def halo_convs(module: nn.Module) -> List[nn.Conv1d]:
    """The causal convolutions of a mixer torchpp runs on a shard with halos (none for others)."""
    convs = [getattr(module, attr, None) for attr in HALO_MIXERS.get(type(module).__name__, ())]
    return [conv for conv in convs if isinstance(conv, nn.Conv1d)]


def halo_length(module: nn.Module) -> Optional[int]:
    """The tokens a ``HALO_MIXERS`` module reads before each of its own, or None for others."""
    name = type(module).__name__
    if name not in HALO_MIXERS:
        return None
    convs = halo_convs(module)
    kernel = getattr(module, "conv_kernel_size", None)
    if convs:
        reach = sum(conv.kernel_size[0] - 1 for conv in convs)
    elif isinstance(kernel, int):
        reach = kernel - 1
    else:
        reach = 0
    reach = max(reach, EXTRA_REACH.get(name, 0))
    return reach if reach > 0 else None


def chunk_owner(chunk: int, size: int, layout: str) -> Tuple[int, int]:
    """(rank, piece) holding global chunk ``chunk`` (inverse of ``chunk_indices``)."""
    if layout == "contiguous":
        return chunk, 0
    return (chunk, 0) if chunk < size else (2 * size - 1 - chunk, 1)


def halos_before(cp: "ContextParallel", pieces: List[torch.Tensor], halo: int) -> List[torch.Tensor]:
    """For each of this rank's pieces, the up to ``halo`` tokens before its chunk in the sequence."""
    size, n = cp.size, pieces[0].size(1)
    tail = min(halo, n)  # halo > n: whole chunks, several of them before each chunk
    tails = gather_from_sp_region(torch.cat([p[:, n - tail:] for p in pieces], dim=1), cp.group, dim=1)
    per_rank = len(pieces)
    halos = []
    for chunk in chunk_indices(cp.group.rank(), size, cp.layout):
        before = min(chunk, math.ceil(halo / n))  # chunks (whole, but for the first) reaching back `halo` tokens
        parts = []
        for previous in range(chunk - before, chunk):
            rank, piece = chunk_owner(previous, size, cp.layout)
            parts.append(tails.narrow(1, (rank * per_rank + piece) * tail, tail))
        # The first chunk takes an empty slice of the gathered tails: every rank's graph then holds the
        # gather, so every rank joins its reduce-scatter in backward (else the others wait forever).
        joined = torch.cat(parts, dim=1) if parts else tails[:, :0]
        halos.append(joined[:, max(0, joined.size(1) - halo):])
    return halos


def run_with_halos(cp: "ContextParallel", inputs: List[List[torch.Tensor]], halo: int, run,
                   out_dim: int) -> torch.Tensor:
    """``run`` on each piece of ``inputs`` (one list of [b, n, ...] pieces per input along the
    sequence) preceded by its halo, the halo's outputs dropped along ``out_dim``; the pieces'
    outputs (a tensor or a tuple of them) joined in shard order."""
    befores = [halos_before(cp, pieces, halo) for pieces in inputs]
    outs = []
    for index in range(len(inputs[0])):
        out = run(*(torch.cat([before[index], pieces[index]], dim=1) for before, pieces in zip(befores, inputs)))
        kept = befores[0][index].size(1)
        outs.append(tuple(None if o is None else o.narrow(out_dim, kept, o.size(out_dim) - kept) for o in out)
                    if isinstance(out, tuple) else out.narrow(out_dim, kept, out.size(out_dim) - kept))
    if isinstance(outs[0], tuple):  # (several tensors along the sequence, ZAYA's q, k, v; or RWKV's (out, no state))
        return tuple(None if parts[0] is None else torch.cat(parts, dim=out_dim) for parts in zip(*outs))
    return torch.cat(outs, dim=out_dim)


def _sharded_forward(forward, cp: "ContextParallel", halo: int, *args, **kwargs):
    cp.calls.made()  # the layer mixes its sequence through sharded code
    bound = inspect.signature(forward).bind(*args, **kwargs)
    names = [name for name in SEQUENCE_INPUTS if isinstance(bound.arguments.get(name), torch.Tensor)]
    n_pieces = len(chunk_indices(0, cp.size, cp.layout))

    def run(*extended):
        bound.arguments.update(zip(names, extended))
        return forward(*bound.args, **bound.kwargs)

    return run_with_halos(cp, [list(bound.arguments[name].chunk(n_pieces, dim=1)) for name in names], halo, run,
                          out_dim=1)


def apply_halos(model: nn.Module, cp: "ContextParallel") -> int:
    """Runs each ``HALO_MIXERS`` module of ``model`` on its shard with halos; returns how many."""
    wrapped = 0
    for module in model.modules():
        halo = halo_length(module)
        if halo is None or getattr(module, "_torchpp_halo", False):  # (the recompute pass applies cp again)
            continue
        module.forward = functools.partial(_sharded_forward, module.forward, cp, halo)
        module._torchpp_halo = True
        wrapped += 1
    return wrapped
