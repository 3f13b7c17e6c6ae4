"""The planner's one dependency on the schedule compiler (torchpp.schedule, issue 3).

Many microbatches make long schedules (p x v x m x 3 actions). Every schedule here settles into
a periodic steady state, so the planner's search estimates a long one from two short ones with
the same period (``exact=False``): the makespan, the spans and the peak activations grow by the
same amount per period (the peaks by nothing, except where a schedule holds every microbatch).
Fixed-order schedules extrapolate exactly (tests/plan/test_search_bounds.py checks it over
uneven per-stage costs and transfer latencies). A cost-aware search may order a longer run
differently, so its estimate carries the idle time of one run of 2 p v microbatches (p v when m
is under 4 p v) over to the full length (the steady state of zb-v and zb-auto has next to no
bubble; within 0.6% in our checks at 2 p v, 1% at p v). For these and for V-Half / V-Min
(which settle slowly when a transfer costs nearly a forward), the ``ESTIMATED`` schedules, the
planner's search re-evaluates its leaders exactly.

A fixed-order schedule is generated once per (name, p, m, v) and simulated on each layout's
costs; a cost-aware one, for an estimate, on costs divided by the first stage's forward, which
layouts differing only in microbatch size share (every cost scales with b).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

# Generators that search on the costs (their order depends on them; the others' does not).
COST_AWARE = ("zb-auto", "zb-v")
# Schedules whose estimate may differ from the full simulation.
ESTIMATED = COST_AWARE + ("v-half", "v-min")


@dataclass(frozen=True)
class ScheduleRun:
    makespan: float
    bubble_ratio: float
    peak_activations: tuple[float, ...]  # per rank, in stage-microbatch units (M_B of one stage)


def _period(name: str, num_ranks: int, num_microbatches: int) -> int:
    """Microbatches per repetition of the steady state, as the generator groups them."""
    if name.startswith("interleaved") or name == "looped-bfs":
        group = min(num_ranks, num_microbatches)
        while num_microbatches % group:
            group += 1
        return group
    if name.startswith("dualpipe"):
        return 2
    return 1


@functools.lru_cache(maxsize=256)
def _generate(name: str, p: int, m: int, v: int, costs: tuple | None, group: int | None):
    from torchpp import schedule as S

    per_stage = None if costs is None else dict(zip(("f", "i", "w"), costs[:3]), comm=costs[3])
    return S.generate(name, num_ranks=p, num_microbatches=m, num_chunks=v, costs=per_stage,
                      microbatch_group_size=group)


def _run(name, p, m, v, f, i, w, comm, group=None, normalize=False):
    from torchpp import schedule as S

    costs = None
    if name in COST_AWARE:
        unit = f[0] if normalize and f[0] > 0 else 1.0
        costs = (tuple(x / unit for x in f), tuple(x / unit for x in i), tuple(x / unit for x in w), comm / unit)
    sim = S.simulate(_generate(name, p, m, v, costs, group), f=list(f), i=list(i), w=list(w), comm=comm)
    span = max(end - start for start, end in zip(sim.span_start, sim.span_end))
    return sim, span


@functools.lru_cache(maxsize=8192)
def simulate_schedule(name: str, num_ranks: int, num_microbatches: int, num_chunks: int,
                      f: tuple[float, ...] | float = 1.0, i: tuple[float, ...] | float = 1.0,
                      w: tuple[float, ...] | float = 1.0, comm: float = 0.0, exact: bool = True) -> ScheduleRun:
    """Generates and simulates a schedule on per-stage costs (tuples: hashable, cached); the
    cost-aware generators (zb-auto, zb-v) schedule on those same per-stage costs.

    Args:
        exact: False estimates a long schedule from two short ones of the same period (see the
            module docstring); True simulates every microbatch.

    Raises:
        ValueError: the schedule cannot serve (p, m, v); the message names the constraint.
    """
    stages = num_ranks * num_chunks
    f, i, w = (tuple(x) if isinstance(x, tuple) else (float(x),) * stages for x in (f, i, w))
    period = _period(name, num_ranks, num_microbatches)
    if name in COST_AWARE:
        # One run, 2 p v microbatches (p v when m is not much longer), on costs scaled to the
        # first forward: layouts that differ in microbatch size alone share it.
        short = 2 * stages if num_microbatches > 4 * stages else stages
        longest = short
    else:
        # Long enough to reach the steady state: warm-up and cool-down span about 2 p v microbatches.
        short = period * -(-max(4 * stages, 2 * period) // period)
        longest = short + period
    if exact or num_microbatches <= longest:
        sim, _ = _run(name, num_ranks, num_microbatches, num_chunks, f, i, w, comm)
        return ScheduleRun(sim.makespan, sim.bubble_ratio, tuple(float(x) for x in sim.peak_activations))
    group = period if period > 1 and not name.startswith("dualpipe") else None
    a, span_a = _run(name, num_ranks, short, num_chunks, f, i, w, comm, group, normalize=True)
    busy = max(a.busy) * num_microbatches / short
    if name in COST_AWARE:
        # A search may order a longer run differently, so no slope between two runs: its idle
        # time (warm-up, cool-down; the steady state has next to none) carries over.
        makespan, span = busy + a.makespan - max(a.busy), busy + span_a - max(a.busy)
        return ScheduleRun(makespan, max(0.0, (span - busy) / span), tuple(float(x) for x in a.peak_activations))
    b, span_b = _run(name, num_ranks, short + period, num_chunks, f, i, w, comm, group, normalize=True)
    periods = (num_microbatches - short - period) // period
    makespan = b.makespan + periods * (b.makespan - a.makespan)
    span = span_b + periods * (span_b - span_a)
    peaks = tuple(float(y + periods * (y - x)) for x, y in zip(a.peak_activations, b.peak_activations))
    return ScheduleRun(makespan, max(0.0, (span - busy) / span), peaks)


def peak_inflight(name: str, num_ranks: int, num_microbatches: int, num_chunks: int = 1) -> list[float]:
    """Peak in-flight stage-microbatches per rank: what the memory model multiplies activations by."""
    return list(simulate_schedule(name, num_ranks, num_microbatches, num_chunks).peak_activations)
