"""Megatron-core on CPU ranks (gloo), for tests only: a shim of its hard-coded CUDA calls.

Megatron allocates with ``device=torch.cuda.current_device()`` (the global memory buffer, RoPE,
DDP's buffers), moves a tied embedding copy with ``.cuda()``, writes ``device="cuda"`` literally
in its schedules and forks the CUDA RNG for dropout. Inside ``megatron_on_cpu()`` these run on
the CPU; everything is restored on exit, so the rank pool stays clean for other tests.
"""
from __future__ import annotations

import contextlib
import types

import torch


class _CpuRngTracker:
    """Megatron's CudaRNGStatesTracker interface; dropout is 0 in the tests, so fork is a no-op."""

    def __init__(self):
        self.states_ = {}

    def reset(self):
        self.states_ = {}

    def get_states(self):
        return dict(self.states_)

    def set_states(self, states):
        self.states_ = dict(states)

    def add(self, name, seed):
        self.states_[name] = seed

    def is_initialized(self):
        return True

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        yield


class _TorchWithCpuDefaults(types.ModuleType):
    """``torch`` as Megatron's schedules see it: a literal device="cuda" means the CPU."""

    def __init__(self):
        super().__init__("torch")

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs):
        return torch.zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)


@contextlib.contextmanager
def megatron_on_cpu():
    """Runs Megatron-core's CUDA-only calls on the CPU within the block."""
    import megatron.core.pipeline_parallel.schedules as schedules
    import megatron.core.tensor_parallel.random as random

    saved = (torch.cuda.current_device, torch.cuda.synchronize, torch.Tensor.cuda, random._CUDA_RNG_STATE_TRACKER,
             random._CUDA_RNG_STATE_TRACKER_INITIALIZED, schedules.torch)
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    random._CUDA_RNG_STATE_TRACKER = _CpuRngTracker()
    random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    schedules.torch = _TorchWithCpuDefaults()
    try:
        yield
    finally:
        (torch.cuda.current_device, torch.cuda.synchronize, torch.Tensor.cuda, random._CUDA_RNG_STATE_TRACKER,
         random._CUDA_RNG_STATE_TRACKER_INITIALIZED, schedules.torch) = saved
