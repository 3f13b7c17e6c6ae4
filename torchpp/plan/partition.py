"""Python face of the C++ partitioner (torchpp._plan): split a profiled layer chain into stages."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from torchpp import _plan
from torchpp.plan.profiler import Profile

PLACEMENTS = ("interleaved", "v-shape")


@dataclass(frozen=True)
class Partition:
    """An exact split; stage k holds layers ``boundaries[k]:boundaries[k+1]``."""

    boundaries: list[int]
    replicas: list[int]
    stage_rank: list[int]
    stage_time: list[float]
    stage_memory: list[float]
    rank_time: list[float]
    rank_memory: list[float]
    comm_time: float
    bottleneck: float

    @property
    def num_stages(self) -> int:
        return len(self.replicas)

    def stage_layers(self, stage: int) -> range:
        return range(self.boundaries[stage], self.boundaries[stage + 1])


def partition(
    costs: Profile | Sequence[float],
    num_workers: int,
    *,
    activation_bytes: Sequence[float] | None = None,
    parameter_bytes: Sequence[float] | None = None,
    saved_activation_bytes: Sequence[float] | None = None,
    state_bytes: Sequence[float] | None = None,
    activation_bandwidth: float = math.inf,
    replicate: bool = False,
    max_replicas: int | None = None,
    sync_bandwidth: float = math.inf,
    memory_budget: float | None = None,
    inflight: Sequence[float] | None = None,
    num_chunks: int = 1,
    placement: str = "interleaved",
) -> Partition:
    """Splits N layers into contiguous stages minimising the slowest rank (PipeDream's DP).

    Args:
        costs: a ``Profile`` from ``torchpp.plan.profile`` or per-layer seconds (forward + backward).
        num_workers: ranks M; without replication and with one chunk there are exactly M stages.
        activation_bytes: bytes each layer sends to the next (defaults to the profile's outputs).
        parameter_bytes: bytes of weights per layer, for the gradient sync of replicated stages.
        saved_activation_bytes: bytes a microbatch keeps alive per layer until its backward.
        state_bytes: resident bytes per layer (weights, grads, optimizer state); defaults to
            4 x parameter bytes (fp32 weights + grads + Adam's two moments).
        activation_bandwidth: bytes/s between stages (inf: free sends).
        replicate: allow a stage on several data-parallel workers (PipeDream's hybrid).
        max_replicas: cap on workers per stage (default: M).
        sync_bandwidth: bytes/s of the all-reduce that syncs replicated gradients.
        memory_budget: bytes per worker nothing may exceed (None: unlimited).
        inflight: peak in-flight microbatches per stage position, e.g. from
            ``torchpp.plan.schedule_peaks``; M entries (M * v when chunked). None: 1 each.
        num_chunks: stages per rank v (> 1: chunked placement).
        placement: ``"interleaved"`` (stage s on rank s % M) or ``"v-shape"`` (v = 2; stage s on
            rank s for s < M, else 2M-1-s, so the first and last stage share rank 0).

    Raises:
        ValueError: inconsistent inputs, or no split fits ``memory_budget`` (message has numbers).
    """
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
    if isinstance(costs, Profile):
        compute = costs.compute_times
        activation_bytes = costs.output_bytes if activation_bytes is None else activation_bytes
        parameter_bytes = costs.parameter_bytes if parameter_bytes is None else parameter_bytes
        saved_activation_bytes = costs.saved_bytes if saved_activation_bytes is None else saved_activation_bytes
    else:
        compute = list(costs)
    if state_bytes is None and parameter_bytes is not None and memory_budget is not None:
        state_bytes = [4.0 * p for p in parameter_bytes]
    result = _plan.partition(
        compute=[float(x) for x in compute],
        activation_bytes=_floats(activation_bytes),
        parameter_bytes=_floats(parameter_bytes),
        state_bytes=_floats(state_bytes),
        saved_activation_bytes=_floats(saved_activation_bytes),
        num_workers=num_workers,
        activation_bandwidth=activation_bandwidth,
        allow_replication=replicate,
        max_replicas=max_replicas or 0,
        sync_bandwidth=sync_bandwidth,
        memory_budget=math.inf if memory_budget is None else float(memory_budget),
        inflight=_floats(inflight),
        num_chunks=num_chunks,
        placement=placement,
    )
    return Partition(
        boundaries=list(result.boundaries),
        replicas=list(result.replicas),
        stage_rank=list(result.stage_rank),
        stage_time=list(result.stage_time),
        stage_memory=list(result.stage_memory),
        rank_time=list(result.rank_time),
        rank_memory=list(result.rank_memory),
        comm_time=result.comm_time,
        bottleneck=result.bottleneck,
    )


def _floats(values: Sequence[float] | None) -> list[float]:
    return [] if values is None else [float(x) for x in values]
