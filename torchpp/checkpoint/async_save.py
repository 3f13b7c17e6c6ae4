"""Checkpoints written by a background thread while training goes on.

``save`` stages the state on the calling thread: it runs the collectives that gather tensors
saved whole and copies every tensor, so later steps cannot change what is written. A thread
then writes, checksums and commits it (torchpp.checkpoint.write_staged) over a gloo process
group of its own: gloo runs collectives of one group in call order, so a group shared by two
threads could pair one thread's collective with the other's on another rank. At most one save
is in flight: the next ``save`` (or ``wait``) first waits for it. The stall of a save is the
staging; the copy costs memory equal to this rank's share of the state until it is written
(on an accelerator, device memory: the copies stay where the parameters are).
"""
from __future__ import annotations

import threading
import time
from typing import Any, Optional

import torch.distributed as dist

from torchpp.checkpoint.api import stage_state, write_staged
from torchpp.checkpoint.layout import ModelLike
from torchpp.parallel.groups import ParallelState


class AsyncCheckpointer:
    """Saves checkpoints like save_checkpoint, with the writing overlapped with training.

    Collective: every rank creates it (it creates the saver's process group) and calls each
    method at the same point. Errors of a background save are raised by the next ``save`` or
    ``wait``, on every rank (DCP and the commit share their errors over the group).

    Args:
        root: the directory of checkpoints (as for save_checkpoint).
        state: the parallel layout (default: the one from torchpp.init_parallel).
    """

    def __init__(self, root: str, state: Optional[ParallelState] = None):
        self.root, self.state = root, state
        self.group = dist.new_group(backend="gloo")  # the saver thread's own; see the module docstring
        self._thread: Optional[threading.Thread] = None
        self._outcome: dict = {}
        self.last_stall_s = 0.0  # how long the last save() held the caller

    def save(self, step: int, model: ModelLike, optimizer=None, *, extra: Any = None, grad_scaler=None) -> None:
        """Stages the state of `step` (waiting first for a save still in flight) and writes it
        in the background. Arguments as save_checkpoint."""
        start = time.perf_counter()
        self.wait()
        staged = stage_state(step, model, optimizer, extra=extra, state=self.state, grad_scaler=grad_scaler,
                             copy_tensors=True)
        self._outcome = {}
        self._thread = threading.Thread(target=self._write, args=(staged,), name=f"torchpp-save-{step}", daemon=True)
        self._thread.start()
        self.last_stall_s = time.perf_counter() - start

    def _write(self, staged) -> None:
        try:
            self._outcome["path"] = write_staged(self.root, staged, group=self.group)
        except BaseException as error:  # noqa: BLE001 (handed to the training thread by wait())
            self._outcome["error"] = error

    @property
    def in_flight(self) -> bool:
        return self._thread is not None

    def wait(self) -> Optional[str]:
        """Waits for the save in flight; returns its committed directory (None when there was
        none) or raises its error."""
        if self._thread is None:
            return None
        self._thread.join()
        self._thread = None
        if "error" in self._outcome:
            raise self._outcome["error"]
        return self._outcome.get("path")

    def close(self) -> Optional[str]:
        """Waits for the last save and releases the saver's process group."""
        try:
            return self.wait()
        finally:
            if self.group is not None:
                dist.destroy_process_group(self.group)
                self.group = None
