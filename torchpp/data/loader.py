"""A resumable loader of packed rows: its position is two integers, the same on every rank.

Each epoch visits the rows in a permutation drawn from (seed, epoch); batch k of an epoch is
rows [k*B, (k+1)*B) of it (a last partial batch is dropped); each data-parallel replica takes
its contiguous share of the global batch. The state, {epoch, batch}, names the next global
batch, not a replica's place, so a checkpoint resumes the same batches under any dp.
(torchdata's StatefulDataLoader keeps per-rank sampler and worker state instead, which would
tie a checkpoint to its dp size, for in-memory rows that need no worker processes.)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List

import torch

from torchpp.data.packing import PackedRows


@dataclass
class Batch:
    """This replica's rows of one global batch."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    epoch: int
    index: int  # the batch's index within its epoch


class PackedLoader:
    """Endless, shuffled, resumable batches of packed rows.

    Args:
        rows: the packed rows.
        batch_size: rows per global batch (over all data-parallel replicas).
        seed: the shuffling seed (epoch e uses seed + e).
        dp_rank, dp_size: this replica and the number of replicas; dp_size divides batch_size.
        shuffle: False visits rows in order (held-out evaluation).
    """

    def __init__(self, rows: PackedRows, batch_size: int, seed: int = 0, dp_rank: int = 0, dp_size: int = 1,
                 shuffle: bool = True):
        if batch_size % dp_size:
            raise ValueError(f"torchpp.data: batch size {batch_size} is not divisible by the data-parallel size "
                             f"{dp_size}")
        if len(rows) < batch_size:
            raise ValueError(f"torchpp.data: {len(rows)} rows ({rows.tokens} tokens) do not fill one batch of "
                             f"{batch_size}; use less --batch or --seq, or more text")
        self.rows, self.batch_size, self.seed, self.shuffle = rows, batch_size, seed, shuffle
        self.local = slice(dp_rank * batch_size // dp_size, (dp_rank + 1) * batch_size // dp_size)
        self.epoch, self.batch = 0, 0
        self._order = None

    @property
    def batches_per_epoch(self) -> int:
        return len(self.rows) // self.batch_size

    def _epoch_order(self) -> torch.Tensor:
        if self._order is None or self._order[0] != self.epoch:
            order = (torch.randperm(len(self.rows), generator=torch.Generator().manual_seed(self.seed + self.epoch))
                     if self.shuffle else torch.arange(len(self.rows)))
            self._order = (self.epoch, order)
        return self._order[1]

    def __iter__(self):
        return self

    def __next__(self) -> Batch:
        if self.batch == self.batches_per_epoch:
            self.epoch, self.batch = self.epoch + 1, 0
        start = self.batch * self.batch_size
        rows = self._epoch_order()[start:start + self.batch_size][self.local]
        batch = Batch(self.rows.input_ids[rows], self.rows.position_ids[rows], self.epoch, self.batch)
        self.batch += 1
        return batch

    def first_batches(self, n: int) -> List[Batch]:
        """The first `n` batches of epoch 0 (at most one epoch's), without moving the position."""
        saved = self.state_dict()
        self.epoch, self.batch = 0, 0
        batches = [next(self) for _ in range(min(n, self.batches_per_epoch))]
        self.load_state_dict(saved)
        return batches

    def state_dict(self) -> Dict[str, Any]:
        """The position (the next global batch) and what it depends on."""
        return {"epoch": self.epoch, "batch": self.batch, "seed": self.seed, "batch_size": self.batch_size,
                "rows": len(self.rows), "shuffle": self.shuffle}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Continues from a position saved by ``state_dict`` of a loader over the same rows."""
        mine = self.state_dict()
        for key in ("seed", "batch_size", "rows", "shuffle"):
            if state[key] != mine[key]:
                raise ValueError(f"torchpp.data: the saved loader had {key}={state[key]}, this one has "
                                 f"{key}={mine[key]}: it would not see the same batches")
        self.epoch, self.batch = state["epoch"], state["batch"]
