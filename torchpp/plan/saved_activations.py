"""Counts the bytes autograd keeps alive for backward (CPU has no allocator statistics)."""
from __future__ import annotations

import weakref
from typing import Iterable

import torch


class _Held:
    """What autograd stores instead of a saved tensor; dies when the graph releases it."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class SavedActivationMeter:
    """Context manager tracking live and peak bytes of tensors saved for backward.

    Storages are counted once however many views of them are saved; parameters (and any
    tensor in ``exclude``) are not activations and are skipped.

    Args:
        exclude: tensors whose storages are never counted (default: none besides parameters).
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        self._excluded = {t.untyped_storage().data_ptr() for t in exclude}
        self._refs: dict[int, int] = {}  # storage pointer -> saved tensors holding it
        self.live_bytes = 0
        self.peak_bytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def __enter__(self) -> "SavedActivationMeter":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes

    def _pack(self, tensor: torch.Tensor) -> object:
        if isinstance(tensor, torch.nn.Parameter) or tensor.untyped_storage().data_ptr() in self._excluded:
            return tensor
        held = _Held(tensor)
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if self._refs.get(key, 0) == 0:
            self.live_bytes += storage.nbytes()
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self._refs[key] = self._refs.get(key, 0) + 1
        weakref.finalize(held, self._release, key, storage.nbytes())
        return held

    def _release(self, key: int, nbytes: int) -> None:
        self._refs[key] -= 1
        if self._refs[key] == 0:
            del self._refs[key]
            self.live_bytes -= nbytes

    @staticmethod
    def _unpack(packed: object) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Held) else packed
