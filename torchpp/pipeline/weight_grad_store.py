"""The weight-gradient store of split B/W linears, keyed by (stage, microbatch).

The pipeline executor drives it (I captures, W runs); these functions expose it for tests and
for hand-written schedules.
"""
from __future__ import annotations

import contextlib

import torch

from torchpp import _C


@contextlib.contextmanager
def capture(stage: int, microbatch: int):
    """Within the block, split-B/W linears' backward defers weight gradients under the key.

    Args:
        stage: stage index of the key.
        microbatch: microbatch index of the key.
    """
    _C.wgrad_begin_capture(stage, microbatch)
    try:
        yield
    finally:
        _C.wgrad_end_capture()


def run(stage: int, microbatch: int) -> int:
    """Runs the weight gradients parked under (stage, microbatch); returns how many ran."""
    return _C.wgrad_run(stage, microbatch)


def pending() -> int:
    """Number of parked weight-gradient computations over all keys."""
    return _C.wgrad_pending()


def clear() -> None:
    """Drops every parked computation (after a failed step)."""
    _C.wgrad_clear()


def use_main_grad(module: torch.nn.Module, dtype: torch.dtype = torch.float32) -> None:
    """Gives every parameter a ``main_grad`` buffer that deferred weight gradients accumulate
    into (Megatron's fp32 gradient accumulation for low-precision parameters).

    Args:
        module: its parameters get ``param.main_grad`` (zeros of ``dtype``).
        dtype: dtype of the buffers.
    """
    for param in module.parameters():
        if not hasattr(param, "main_grad"):
            param.main_grad = torch.zeros_like(param, dtype=dtype)
        _C.wgrad_set_main_grad(param, param.main_grad)
