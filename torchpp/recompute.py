"""Activation recomputation (Megatron-3): keep a block's input, recompute its insides in backward.

Two granularities, chosen per stage:

- ``"full"``: each transformer block is checkpointed; only its input is kept (2sbh bytes a
  layer) and the whole block runs again during backward.
- ``"selective"``: only the attention core (QK^T, softmax, dropout, attention over V) is
  recomputed; it holds the O(s^2) activations but costs little compute to redo.

Recomputation replays the same randomness: torch.utils.checkpoint restores the default
generator, and ``checkpoint`` here also restores the tensor-parallel RNG tracker's streams,
so dropout masks inside TP regions match the first forward and gradients are unchanged.
Non-reentrant checkpointing recomputes inside the ordinary backward, so the split B/W
linears' deferred weight gradients (a zero-bubble schedule's W pass) keep working.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.utils.checkpoint

from torchpp.tensor_parallel.random import get_rng_tracker

RECOMPUTE_MODES = (None, "full", "selective")


def check_recompute_mode(mode: Optional[str]) -> Optional[str]:
    """Returns ``mode`` if it names a recompute granularity, else raises ValueError."""
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"torchpp: recompute={mode!r} must be one of {RECOMPUTE_MODES}")
    return mode


def checkpoint(function: Callable, *args, **kwargs):
    """``function(*args, **kwargs)`` keeping only its inputs; recomputed during backward.

    Args:
        function: the computation to recompute (a block, or the attention core).
        *args, **kwargs: its inputs (kept alive until backward).
    """
    if not torch.is_grad_enabled():
        return function(*args, **kwargs)
    tracker = get_rng_tracker()
    states_at_forward = tracker.get_states()
    calls = 0

    def run(*inner_args, **inner_kwargs):
        nonlocal calls
        calls += 1
        if calls == 1:  # the original forward advances the TP streams as usual
            return function(*inner_args, **inner_kwargs)
        # Recompute: replay the TP streams from where the forward began, then put them back.
        current = tracker.get_states()
        tracker.set_states(states_at_forward)
        try:
            return function(*inner_args, **inner_kwargs)
        finally:
            tracker.set_states(current)

    return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)
