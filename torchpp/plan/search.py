"""Branch and bound over layouts: rank the best ``keep`` exactly without simulating the rest.

Every layout gets a lower bound on its step time that needs no schedule: each pipeline rank
runs its passes one at a time, so the step lasts at least as long as the rank whose first
forward can start the latest (its stage's inputs must cross every earlier stage) plus all the
work of that rank, plus the data-parallel gradient reduction, which is exact. Memory is checked
before any simulation as well: model state plus one in-flight microbatch must fit. Layouts are
then visited cheapest bound first; once ``keep`` candidates are known, a layout whose bound is
not below the ``keep``-th best step time cannot enter the ranking, nor can any after it.

Long schedules are estimated from short ones (torchpp.plan.schedule_sim), exactly for
fixed-order schedules; the leaders whose schedule is only estimated (cost-aware, V-Half, V-Min)
are re-evaluated exactly, and the search goes on if that raised the bar. With ``keep=None``
every layout is evaluated exactly (the exhaustive reference the bounds are tested against,
tests/plan/test_search_bounds.py).
"""
from __future__ import annotations

import bisect

from torchpp.plan import cost_model as C
from torchpp.plan.layout import Candidate, Cluster, Layout, Training
from torchpp.plan.model_config import ModelConfig
from torchpp.plan.schedule_sim import ESTIMATED

# Estimates within this fraction of the bar are re-evaluated exactly before the bar is trusted.
SLACK = 0.01


def _stage_ranks(name: str, p: int, v: int) -> tuple[list[int], int]:
    """(rank of each stage, stages per pipeline) without generating the schedule."""
    if name in C.V_SHAPED or name == "dualpipe":
        return [s if s < p else 2 * p - 1 - s for s in range(2 * p)], (p if name == "dualpipe" else 2 * p)
    return [s % p for s in range(p * v)], p * v


def lower_bound(model: ModelConfig, cluster: Cluster, training: Training, layout: Layout) -> float:
    """A step time no schedule of ``layout`` can beat (see the module docstring)."""
    costs = C.costs_of(model, cluster, training, layout)
    dp_sync = C.dp_sync_seconds(model, cluster, training, layout)
    m, p = layout.num_microbatches, layout.pp
    if p == 1:
        return m * (costs.f[0] + costs.i[0] + costs.w[0]) + dp_sync
    ranks, per_pipeline = _stage_ranks(layout.schedule, p, layout.chunks)
    pipelines = len(ranks) // per_pipeline
    start, busy = [float("inf")] * p, [0.0] * p
    for first in range(0, len(ranks), per_pipeline):
        reach = 0.0  # earliest start of each stage's first forward along its pipeline
        for s in range(first, first + per_pipeline):
            r = ranks[s]
            start[r] = min(start[r], reach)
            busy[r] += m / pipelines * (costs.f[s] + costs.i[s] + costs.w[s])
            reach += costs.f[s] + costs.p2p
    return max(a + b for a, b in zip(start, busy)) + dp_sync


def least_memory(model: ModelConfig, training: Training, layout: Layout) -> float:
    """Bytes the fullest GPU needs at least: model state and one in-flight microbatch per rank."""
    return max(C.rank_memory(model, training, layout, [1.0] * layout.pp))


class _Ranking:
    """The best candidates seen, and the bar a layout's bound must beat to matter."""

    def __init__(self, keep: int):
        self.keep = keep
        self.best: dict[Layout, tuple] = {}  # layout -> (sort key, candidate, exact)
        self.keys: list[tuple] = []  # the sort keys, sorted

    def offer(self, index: int, cand: Candidate, exact: bool) -> None:
        self.remove(cand.layout)
        key = (*cand.sort_key, index)
        self.best[cand.layout] = (key, cand, exact)
        bisect.insort(self.keys, key)

    def remove(self, layout: Layout) -> None:
        if layout in self.best:
            self.keys.pop(bisect.bisect_left(self.keys, self.best.pop(layout)[0]))

    def bar(self) -> float:
        """The keep-th best step time (inf until that many are known), widened by SLACK."""
        return self.keys[self.keep - 1][0] * (1 + SLACK) if len(self.keys) >= self.keep else float("inf")

    def leaders(self) -> list[tuple]:
        """Entries whose step is within the bar: the ones that can still be ranked."""
        bar = self.bar()
        return [entry for entry in self.best.values() if entry[0][0] <= bar]


def search(model: ModelConfig, cluster: Cluster, training: Training, layouts: list[Layout], keep: int | None,
           rejected: dict[str, int]):
    """(the ranked candidates, the smallest-memory candidate that did not fit or None).

    Args:
        layouts: every layout to consider, in enumeration order (the final tie-break).
        keep: how many of the best to rank exactly; None evaluates every layout exactly.
        rejected: counts by reason, filled in.
    """
    def reject(reason: str) -> None:
        rejected[reason] = rejected.get(reason, 0) + 1

    smallest = None
    # Two queues, each cheapest bound first: layouts whose schedule simulates exactly at any
    # length, then the ones only estimated (cost-aware searches are dear, and the first queue
    # has set a tight bar by then).
    queues: tuple[list, list] = ([], [])
    for index, layout in enumerate(layouts):
        try:
            bound = lower_bound(model, cluster, training, layout)
        except ValueError:
            reject("schedule constraint")
            continue
        queues[layout.pp > 1 and layout.schedule in ESTIMATED].append((bound, index, layout))
    for queue in queues:
        queue.sort(key=lambda x: (x[0], x[1]))
    ranking = _Ranking(keep if keep is not None else len(layouts) + 1)
    exact_everywhere = keep is None
    positions = [0, 0]
    while True:
        for q, queue in enumerate(queues):
            while positions[q] < len(queue) and queue[positions[q]][0] <= ranking.bar():
                _, index, layout = queue[positions[q]]
                positions[q] += 1
                if keep is not None and least_memory(model, training, layout) > cluster.gpu_memory:
                    reject("out of memory")  # before any simulation: state plus one microbatch
                    continue
                try:
                    cand = _candidate(model, cluster, training, layout, exact_everywhere)
                except ValueError:  # the schedule cannot serve (p, m, v)
                    reject("schedule constraint")
                    continue
                if cand.memory_per_gpu > cluster.gpu_memory:
                    reject("out of memory")
                    if smallest is None or cand.memory_per_gpu < smallest.memory_per_gpu:
                        smallest = cand
                    continue
                ranking.offer(index, cand, exact_everywhere or q == 0)
        estimated = [(key, cand) for key, cand, exact in ranking.leaders() if not exact]
        for key, cand in estimated:  # the leaders, exactly; a raised bar lets more layouts in
            exact = C.evaluate(model, cluster, training, cand.layout)
            if exact.memory_per_gpu > cluster.gpu_memory:
                ranking.remove(cand.layout)
                reject("out of memory")
                continue
            ranking.offer(key[-1], exact, True)
        if not estimated:
            break
    pruned = sum(len(queue) - position for queue, position in zip(queues, positions))
    if pruned:
        rejected["bound above the leaders"] = pruned
    entries = sorted(entry for entry in ranking.best.values() if entry[2])
    return [cand for _, cand, _ in entries], smallest


def _candidate(model: ModelConfig, cluster: Cluster, training: Training, layout: Layout, exact: bool) -> Candidate:
    costs = C.costs_of(model, cluster, training, layout)
    return C.candidate(model, cluster, training, layout, C.run_schedule(costs, layout, exact=exact), costs)
