"""The planner's one dependency on the schedule compiler (torchpp.schedule, issue 3)."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class ScheduleRun:
    makespan: float
    bubble_ratio: float
    peak_activations: tuple[float, ...]  # per rank, in stage-microbatch units (M_B of one stage)


@functools.lru_cache(maxsize=4096)
def simulate_schedule(name: str, num_ranks: int, num_microbatches: int, num_chunks: int,
                      f: tuple[float, ...] | float = 1.0, i: tuple[float, ...] | float = 1.0,
                      w: tuple[float, ...] | float = 1.0, comm: float = 0.0) -> ScheduleRun:
    """Generates and simulates a schedule; per-stage costs as tuples (hashable, cached).

    Raises:
        ValueError: the schedule cannot serve (p, m, v); the message names the constraint.
    """
    from torchpp import schedule as S

    sch = S.generate(name, num_ranks=num_ranks, num_microbatches=num_microbatches, num_chunks=num_chunks,
                     costs=(_mean(f), _mean(i), _mean(w), comm))
    sim = S.simulate(sch, f=_arg(f), i=_arg(i), w=_arg(w), comm=comm)
    return ScheduleRun(sim.makespan, sim.bubble_ratio, tuple(float(x) for x in sim.peak_activations))


def peak_inflight(name: str, num_ranks: int, num_microbatches: int, num_chunks: int = 1) -> list[float]:
    """Peak in-flight stage-microbatches per rank: what the memory model multiplies activations by."""
    return list(simulate_schedule(name, num_ranks, num_microbatches, num_chunks).peak_activations)


def _arg(costs):
    return list(costs) if isinstance(costs, tuple) else costs


def _mean(costs: Sequence[float] | float) -> float:
    return sum(costs) / len(costs) if isinstance(costs, tuple) else costs
