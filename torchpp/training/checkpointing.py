"""Periodic checkpoints of a training loop and its automatic resume.

A checkpoint holds the model, the optimizer (with its param-group options, so the current
learning rate), every rank's RNG states and the step (torchpp.checkpoint), plus the objects a
loop needs to continue exactly where it stopped: the data loader's position and the LR
scheduler's state, in the checkpoint's `extra`. A job that finds a checkpoint in its
directory resumes from the latest complete one by itself.
"""
from __future__ import annotations

import time
from typing import Any, Dict, Optional

from torchpp.checkpoint import AsyncCheckpointer, load_checkpoint, save_checkpoint
from torchpp.checkpoint.directory import on_rank0, resolve_latest


class CheckpointLoop:
    """Saves every `every` steps (and at the end) and resumes from the latest checkpoint.

    Collective: every rank creates it and calls each method at the same step.

    Args:
        root: the checkpoint directory (shared by every rank).
        every: save after every `every` steps (0: only at the end).
        model: this rank's model (a parallelize'd model at any pp, or {name: parameter}).
        optimizer: its optimizer (a torchpp DistributedOptimizer or a torch.optim one).
        stateful: {name: object with state_dict()/load_state_dict()} saved with it (the data
            loader, the LR scheduler).
        asynchronous: write in a background thread while training goes on (AsyncCheckpointer).
        verify: check the checksums of the checkpoint resumed from.
    """

    def __init__(self, root: str, every: int, model, optimizer, *, stateful: Optional[Dict[str, Any]] = None,
                 asynchronous: bool = True, verify: bool = True):
        self.root, self.every, self.model, self.optimizer = root, every, model, optimizer
        self.stateful = dict(stateful or {})
        self.verify = verify
        self.saver = AsyncCheckpointer(root) if asynchronous else None
        self.last_saved = -1
        self.stall_s = 0.0  # how long the last save held the training loop

    def resume(self) -> Optional[int]:
        """Loads the latest checkpoint of `root` if there is one (model, optimizer, RNG, and each
        stateful object); returns its step, or None when there is none (a fresh start)."""
        if on_rank0(lambda: resolve_latest(self.root)[0]) is None:
            return None
        loaded = load_checkpoint(self.root, self.model, self.optimizer, verify=self.verify)
        saved = loaded.extra or {}
        missing = [name for name in self.stateful if name not in saved]
        if missing:
            raise KeyError(f"torchpp.training: {loaded.path} holds no state of {missing} (it holds {sorted(saved)})")
        for name, obj in self.stateful.items():
            obj.load_state_dict(saved[name])
        self.last_saved = loaded.step
        return loaded.step

    def after_step(self, step: int, last: bool = False) -> bool:
        """Saves `step` when it is due (every `every` steps, or the `last` one); returns whether it did."""
        due = (self.every > 0 and step % self.every == 0) or last
        if not due or step == self.last_saved:
            return False
        start = time.perf_counter()
        extra = {name: obj.state_dict() for name, obj in self.stateful.items()}
        if self.saver is not None:
            self.saver.save(step, self.model, self.optimizer, extra=extra)
        else:
            save_checkpoint(self.root, step, self.model, self.optimizer, extra=extra)
        self.stall_s = time.perf_counter() - start
        self.last_saved = step
        return True

    def close(self) -> Optional[str]:
        """Waits for a save in flight (its error raises here) and releases the saver."""
        return self.saver.close() if self.saver is not None else None
