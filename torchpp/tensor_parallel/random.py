"""RNG streams for tensor parallelism.

Dropout on activations that are split over TP ranks (inside a TP region) must differ per TP
rank, or every shard would drop the same positions; dropout on replicated activations must be
identical on every TP rank. Data-parallel replicas use the same streams (same seed), so a
layout change does not change the model's randomness.

    torchpp.tensor_parallel.model_parallel_manual_seed(1234, tp_rank=tp_rank)
    with torchpp.tensor_parallel.get_rng_tracker().fork():
        x = F.dropout(x, p)     # per-TP-rank stream
"""
from __future__ import annotations

import contextlib
from typing import Dict, Iterator, Optional

import torch

TP_RNG_STATE = "model-parallel-rng"
# Megatron's offset between the default seed and the TP streams' seeds.
TP_SEED_OFFSET = 2718


def _device_type(device: Optional[torch.device | str]) -> str:
    if device is None:
        return torch.accelerator.current_accelerator().type if torch.accelerator.is_available() else "cpu"
    return torch.device(device).type


def _get_state(device_type: str) -> torch.Tensor:
    if device_type == "cpu":
        return torch.get_rng_state()
    return torch.get_device_module(device_type).get_rng_state()


def _set_state(device_type: str, state: torch.Tensor) -> None:
    if device_type == "cpu":
        torch.set_rng_state(state)
    else:
        torch.get_device_module(device_type).set_rng_state(state)


class RNGStatesTracker:
    """Named RNG states for one device type, swapped in and out of the default generator.

    Args:
        device: the device whose default generator the streams drive (default: the current
            accelerator, else CPU).
    """

    def __init__(self, device: Optional[torch.device | str] = None):
        self.device_type = _device_type(device)
        self._states: Dict[str, torch.Tensor] = {}

    def reset(self) -> None:
        self._states = {}

    def add(self, name: str, seed: int) -> None:
        """Registers a stream `name` seeded with `seed`; names must be new."""
        if name in self._states:
            raise ValueError(f"torchpp: RNG state {name!r} already exists")
        saved = _get_state(self.device_type)
        try:
            if self.device_type == "cpu":
                torch.manual_seed(seed)
            else:
                torch.get_device_module(self.device_type).manual_seed(seed)
            self._states[name] = _get_state(self.device_type)
        finally:
            _set_state(self.device_type, saved)

    def get_states(self) -> Dict[str, torch.Tensor]:
        """A copy of every stream's state (for checkpoints and recomputation)."""
        return {name: state.clone() for name, state in self._states.items()}

    def set_states(self, states: Dict[str, torch.Tensor]) -> None:
        self._states = {name: state.clone() for name, state in states.items()}

    @contextlib.contextmanager
    def fork(self, name: str = TP_RNG_STATE) -> Iterator[None]:
        """Runs the block on stream `name`, then restores the default stream."""
        if name not in self._states:
            raise KeyError(f"torchpp: RNG state {name!r} was never added (call model_parallel_manual_seed)")
        saved = _get_state(self.device_type)
        _set_state(self.device_type, self._states[name])
        try:
            yield
        finally:
            self._states[name] = _get_state(self.device_type)
            _set_state(self.device_type, saved)


_TRACKER: Optional[RNGStatesTracker] = None


def get_rng_tracker() -> RNGStatesTracker:
    """The process-wide tracker (created on first use for the current device type)."""
    global _TRACKER
    if _TRACKER is None:
        _TRACKER = RNGStatesTracker()
    return _TRACKER


def model_parallel_manual_seed(seed: int, tp_rank: int, pp_rank: int = 0) -> None:
    """Seeds the default stream (same on every TP rank and DP replica; varied per pipeline
    stage so stages do not share dropout masks) and the TP stream (varied per TP rank).

    Args:
        seed: the run's seed.
        tp_rank: this rank's index in its TP group.
        pp_rank: this rank's pipeline stage index.
    """
    default_seed = seed + 100 * pp_rank
    tracker = get_rng_tracker()
    tracker.reset()
    torch.manual_seed(default_seed)
    tracker.add(TP_RNG_STATE, default_seed + TP_SEED_OFFSET + tp_rank)


def rng_restored(device: torch.device) -> contextlib.AbstractContextManager:
    """Random draws inside leave the CPU's and ``device``'s generators as they were: a trial or
    reference forward must not shift what the real one draws (dropout, a sampling router)."""
    devices = [device] if device.type not in ("cpu", "meta") else []
    return torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda")
