"""The non-finite guard: a step whose global gradient norm is inf or NaN is skipped on every
rank, and a run of such steps ends in an error that says where the bad gradient appeared.

One NaN in one gradient makes the global norm NaN, so clipping by it (or Adam's update without
clipping) would turn every parameter on every rank into NaN. The norm is all-reduced over the
ranks that hold the model (or its ZeRO shards), so every rank reaches the same verdict from the
same scalar, skips the same update and counts the same run of skips. Which parameter held the
bad value is only looked up after a skip (a gather of one small record per rank).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from torchpp.parallel.object_collectives import all_gather_objects

DEFAULT_SKIP_LIMIT = 3


class NonFiniteGradientError(RuntimeError):
    """Raised on every rank when ``skip_limit`` consecutive steps had a non-finite gradient norm."""


@dataclass
class NonFiniteReport:
    """Where a skipped step's non-finite gradients were, over the ranks that computed its norm.

    Attributes:
        norm: the global gradient norm (inf or nan).
        rank: the lowest global rank holding a non-finite gradient (None: only the sum overflowed).
        name: the first such parameter on that rank (in the optimizer's order).
        per_rank: global rank -> how many of its gradients held an inf or NaN.
    """

    norm: float
    rank: Optional[int]
    name: Optional[str]
    per_rank: Dict[int, int]

    def where(self) -> str:
        if self.rank is None:
            return (f"no single gradient holds an inf or NaN (ranks {sorted(self.per_rank)}): the sum of squares "
                    f"overflowed float32")
        counts = ", ".join(f"rank {r}: {n}" for r, n in sorted(self.per_rank.items()))
        return f"first in {self.name!r} on global rank {self.rank} (non-finite gradients per rank: {counts})"


def parameter_names(params: Sequence[torch.Tensor], names: Optional[Sequence[Optional[str]]]) -> Dict[int, str]:
    """id(param) -> its name (given, else its index and shape on this rank)."""
    out = {}
    for k, param in enumerate(params):
        given = names[k] if names is not None else None
        out[id(param)] = given if given else f"parameter {k} of this rank (shape {list(param.shape)})"
    return out


def locate_nonfinite(pairs: Sequence[Tuple[Optional[torch.Tensor], torch.Tensor]], names: Dict[int, str],
                     groups: Sequence[Optional[dist.ProcessGroup]], norm: torch.Tensor) -> NonFiniteReport:
    """Which ranks' gradients in ``pairs`` ((gradient, owning parameter), as the norm counted
    them) hold an inf or NaN. Collective over each of ``groups`` in turn (the norm's group, then
    the data-parallel group when the norm did not span it; None: this rank alone), so every
    rank of the run gets every rank's record."""
    first, count = None, 0
    for grad, param in pairs:
        if grad is not None and not bool(torch.isfinite(grad).all()):
            count += 1
            if first is None:
                first = names.get(id(param), "a parameter not given to the optimizer")
    records: List[tuple] = [(dist.get_rank() if dist.is_initialized() else 0, first, count)]
    for group in groups:
        if group is None or dist.get_world_size(group) == 1:
            continue
        records = [record for part in all_gather_objects(records, group) for record in part]
    records.sort()
    bad = [r for r in records if r[2] > 0]
    return NonFiniteReport(norm=float(norm), rank=bad[0][0] if bad else None, name=bad[0][1] if bad else None,
                           per_rank={r[0]: r[2] for r in records})


class SkipCounter:
    """Counts consecutive skipped steps and raises NonFiniteGradientError at ``limit``.

    Args:
        limit: the number of consecutive skips that raises (None: never raise).
    """

    def __init__(self, limit: Optional[int] = DEFAULT_SKIP_LIMIT):
        if limit is not None and (not isinstance(limit, int) or limit < 1):
            raise ValueError(f"skip_limit must be a positive int or None, got {limit!r}")
        self.limit = limit
        self.consecutive = 0
        self.total = 0
        self.first: Optional[NonFiniteReport] = None  # the first skip of the current run of skips

    def passed(self) -> None:
        self.consecutive = 0
        self.first = None

    def skipped(self, report: NonFiniteReport) -> None:
        self.consecutive += 1
        self.total += 1
        if self.first is None:
            self.first = report
        limit = "" if self.limit is None else f"; skip_limit {self.limit}"
        if self.limit is not None and self.consecutive >= self.limit:
            raise NonFiniteGradientError(
                f"torchpp DistributedOptimizer: the global gradient norm was not finite for {self.consecutive} "
                f"consecutive steps (skip_limit={self.limit}); each of their updates was skipped on every rank, so "
                f"the parameters are those before the first of them. Where it appeared (first skipped step, norm "
                f"{self.first.norm}): {self.first.where()}. Last step: norm {report.norm}, {report.where()}. Check "
                f"the data and the learning rate, or raise skip_limit")
        if not dist.is_initialized() or dist.get_rank() == 0:  # every rank knows it; one line is enough
            warnings.warn(f"torchpp DistributedOptimizer: global gradient norm {report.norm}: update skipped on every "
                          f"rank ({self.consecutive} in a row{limit}); {report.where()}", RuntimeWarning,
                          stacklevel=3)
