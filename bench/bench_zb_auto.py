"""zb-auto against the zero-bubble paper's own heuristic scheduler, side by side on the same
costs and memory limit: 150 settings (p in 4, 6, 8, 12, 16; m = p, 2p, 3p; limit p and 2p M_B;
five cost mixes), M_W = M_B / 2 on both sides. Both schedules are timed by torchpp's simulator;
the table compares the longest rank span (the paper's objective) and the makespan.

``--per-stage ends`` gives both schedulers the same per-stage costs instead: each mix with a
heavier first stage (the embedding: F and I x1.2, W x1.1) and last stage (output layer and loss:
every pass x1.6), as real pipelines have; ``--per-stage random`` also scales every stage's passes
by a factor drawn in [0.75, 1.25] (seeded: uneven partitions). zb-auto is also compared with
itself built from the costs' medians.

The reference is the paper's code, not a re-implementation: fetch the repository and point
--reference at its scheduler module (its heuristic, ``Graph.manual_order``, runs as is; the
imports it needs only for its ILP and its runtime are stubbed):

    git clone https://github.com/sail-sg/zero-bubble-pipeline-parallelism /tmp/zbpp
    PYTHONPATH=. python bench/bench_zb_auto.py \\
        --reference /tmp/zbpp/megatron/core/pipeline_parallel/zerobubble/scheduler/zb.py
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import random
import statistics
import sys
import tempfile
import time
import types
from dataclasses import dataclass

from torchpp import schedule as S

RANKS = (4, 6, 8, 12, 16)
# (F, I, W, comm): equal passes; the paper's I + W = 2F split with cheap and dearer transfers;
# a small W (long sequences); and slow transfers.
MIXES = ((1.0, 1.0, 1.0, 0.0), (1.0, 1.2, 0.8, 0.05), (1.0, 1.2, 0.8, 0.1), (1.0, 1.5, 0.5, 0.0),
         (1.0, 1.1, 0.9, 0.25))


def load_reference(path: str):
    """The reference module's Graph class, with stand-ins for what its heuristic never uses."""
    for name in ("pulp", "megatron", "megatron.core", "megatron.core.pipeline_parallel",
                 "megatron.core.pipeline_parallel.zerobubble", "megatron.core.pipeline_parallel.zerobubble.scheduler"):
        sys.modules.setdefault(name, types.ModuleType(name))
    graph = types.ModuleType("megatron.core.pipeline_parallel.zerobubble.scheduler.graph")
    graph.GraphConfig = graph.ScheduledNode = graph.FuncType = object
    sys.modules[graph.__name__] = graph
    spec = importlib.util.spec_from_file_location("zb_reference", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Graph


@dataclass
class Config:
    """The fields of the reference's GraphConfig that its heuristic reads."""
    cost_f: list
    cost_b: list
    cost_w: list
    cost_comm: float
    mem_f: list
    mem_b: list
    mem_w: list
    max_mem: list


FIRST, LAST = (1.2, 1.2, 1.1), (1.6, 1.6, 1.6)  # --per-stage: F, I, W factors of the end stages


def stage_costs(p, costs, per_stage, setting=0):
    """([F per stage], [I per stage], [W per stage], comm)."""
    lists = [[c] * p for c in costs[:3]]
    if per_stage:
        for k in range(3):
            lists[k][0] *= FIRST[k]
            lists[k][-1] *= LAST[k]
    if per_stage == "random":
        rng = random.Random(setting)
        for s in range(p):
            factor = rng.uniform(0.75, 1.25)
            for k in range(3):
                lists[k][s] *= factor
    return (*lists, costs[3])


def reference_schedule(Graph, p, m, costs, limit, weight_pending, path):
    """The reference's pick among its 8 settings (shortest span, first wins, as its
    ``initial_solution``), written as a torchpp CSV and loaded. A setting that cannot fit the
    limit raises in the reference; it is skipped (the reference would stop there)."""
    f, i, w, comm = costs  # per-stage lists
    # Memory deltas per pass: F takes M_B, I trades M_B for M_W, W frees M_W.
    config = Config(list(f), list(i), list(w), comm, [1.0] * p, [weight_pending - 1.0] * p, [-weight_pending] * p,
                    [float(limit)] * p)
    graph = Graph(nstages=p, nmb=m, nnodes=3 * p * m, config=config)
    best = None
    for ends_before in (True, False):
        for skip in (True, False):
            for fill_every_gap in (True, False):
                try:
                    order, _, span = graph.manual_order(ends_before, skip, fill_every_gap)
                except ValueError:
                    continue
                if best is None or span < best[0]:
                    best = (span, order, (ends_before, skip, fill_every_gap))
    if best is None:
        return None, None
    _, order, setting = best
    rows = []
    for stage in range(p):
        nodes = [(order[graph.get_id(kind, stage, mb)], f"{stage}{'FIW'[kind]}{mb}") for kind in range(3) for mb in range(m)]
        rows.append(",".join(name for _, name in sorted(nodes)))
    with open(path, "w") as out:
        out.write("\n".join(rows) + "\n")
    return S.from_csv(path, p, m), setting


def measure(schedule, costs, weight_pending):
    f, i, w, comm = costs
    sim = S.simulate(schedule, f=f, i=i, w=w, comm=comm, weight_pending=weight_pending)
    span = max(e - s for s, e in zip(sim.span_start, sim.span_end))
    return span, sim.makespan, max(sim.peak_memory)


GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "schedule", "reference",
                      "zb_paper_heuristic.csv")


def recorded_reference():
    """{(p, m, limit, f, i, w, comm, M_W): (span, makespan, peak)} of the paper's scheduler, as
    written by --golden (so the comparison runs where the reference's code cannot be fetched)."""
    import csv

    with open(GOLDEN) as f:
        return {(int(r["p"]), int(r["m"]), float(r["memory_limit"]), float(r["f"]), float(r["i"]), float(r["w"]),
                 float(r["comm"]), float(r["weight_pending"])): (float(r["span"]), float(r["makespan"]),
                                                                float(r["peak_memory"]))
                for r in csv.DictReader(f)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reference", help="the reference's zerobubble/scheduler/zb.py (default: its results "
                                            "recorded in tests/schedule/reference/zb_paper_heuristic.csv)")
    parser.add_argument("--weight-pending", type=float, default=0.5, help="M_W in units of M_B (default 0.5)")
    parser.add_argument("--objective", default="makespan", choices=("makespan", "span"), help="zb-auto's objective")
    parser.add_argument("--verbose", action="store_true", help="print every setting")
    parser.add_argument("--per-stage", choices=("ends", "random"), help="per-stage costs (see above)")
    parser.add_argument("--golden", help="write the reference's span and makespan per setting to this CSV "
                                         "(tests/schedule/reference/zb_paper_heuristic.csv)")
    args = parser.parse_args()
    Graph = load_reference(args.reference) if args.reference else None
    if args.per_stage and Graph is None:
        parser.error("--per-stage needs --reference (the recording has uniform costs only)")
    recorded = {} if Graph else recorded_reference()
    median_longer = []  # --per-stage: settings where the median's schedule is the shorter
    wp = args.weight_pending
    tally = {"span": [0, 0, 0], "makespan": [0, 0, 0]}  # zb-auto better, equal, worse
    worst = {"span": (0.0, "none"), "makespan": (0.0, "none")}
    best_gain = {"span": (0.0, "none"), "makespan": (0.0, "none")}
    times, over_limit, refused, golden = [], [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for p in RANKS:
            for m in (p, 2 * p, 3 * p):
                for limit in (p, 2 * p):
                    for costs in MIXES:
                        where = f"p={p} m={m} limit={limit} costs={'/'.join(f'{c:g}' for c in costs)}"
                        staged = stage_costs(p, costs, args.per_stage, len(times))
                        start = time.perf_counter()
                        ours = S.generate("zb-auto", p, m, costs=dict(zip("fiw", staged[:3]), comm=costs[3],
                                                                      weight_pending=wp), memory_limit=limit,
                                          objective=args.objective)
                        times.append(time.perf_counter() - start)
                        if args.per_stage:
                            medians = [statistics.median(x) for x in staged[:3]]
                            median = S.generate("zb-auto", p, m, costs=dict(zip("fiw", medians), comm=costs[3],
                                                                            weight_pending=wp),
                                                memory_limit=limit, objective=args.objective)
                            key = 0 if args.objective == "span" else 1  # the objective's measure
                            if measure(median, staged, wp)[key] < measure(ours, staged, wp)[key] - 1e-9:
                                median_longer.append(where)
                        if Graph is not None:
                            theirs, setting = reference_schedule(Graph, p, m, staged, limit, wp,
                                                                 os.path.join(tmp, "ref.csv"))
                        else:  # offline: the reference's span, makespan and peak as recorded
                            theirs, setting = recorded.get((p, m, float(limit), *map(float, costs), wp)), "recorded"
                        a = measure(ours, staged, wp)
                        if a[2] > limit + 1e-9:
                            over_limit.append(f"zb-auto {where}: {a[2]:g}")
                        if theirs is None:
                            refused.append(where)
                            continue
                        b = measure(theirs, staged, wp) if Graph is not None else theirs
                        golden.append(f"{p},{m},{limit},{','.join(f'{c:g}' for c in costs)},{wp:g},{b[0]!r},{b[1]!r},{b[2]:g}")
                        if b[2] > limit + 1e-9:
                            over_limit.append(f"reference {where}: {b[2]:g}")
                        for key, ours_v, theirs_v in (("span", a[0], b[0]), ("makespan", a[1], b[1])):
                            gap = (ours_v - theirs_v) / theirs_v  # > 0: zb-auto is slower
                            tally[key][0 if gap < -1e-9 else 1 if gap <= 1e-9 else 2] += 1
                            if gap > max(worst[key][0], 1e-9):
                                worst[key] = (gap, f"{where}: {ours_v:.2f} vs {theirs_v:.2f}")
                            if gap < min(best_gain[key][0], -1e-9):
                                best_gain[key] = (gap, f"{where}: {ours_v:.2f} vs {theirs_v:.2f}")
                        if args.verbose:
                            print(f"{where:50} span {a[0]:8.2f} {b[0]:8.2f}  makespan {a[1]:8.2f} {b[1]:8.2f}  "
                                  f"peak {a[2]:5.1f} {b[2]:5.1f}  reference setting {setting}")
    if args.golden:
        with open(args.golden, "w") as out:
            out.write("p,m,memory_limit,f,i,w,comm,weight_pending,span,makespan,peak_memory\n")
            out.write("\n".join(golden) + "\n")
    settings = len(times)
    print(f"{settings} settings{f' with per-stage costs ({args.per_stage})' if args.per_stage else ''}, M_W = {wp:g} M_B, zb-auto "
          f"objective {args.objective}; zb-auto vs the paper's heuristic (both simulated by torchpp)")
    for key in ("span", "makespan"):
        better, equal, worse = tally[key]
        print(f"{key:9} zb-auto better {better:3}, equal {equal:3}, worse {worse:3}; "
              f"worst gap {100 * worst[key][0]:+.2f}% ({worst[key][1]}); "
              f"largest lead {100 * best_gain[key][0]:+.2f}% ({best_gain[key][1]})")
    print(f"over the limit: {over_limit or 'none'}; reference could not fit: {refused or 'none'}")
    if args.per_stage:
        print(f"zb-auto from the medians shorter ({args.objective}) than from the per-stage costs: "
              f"{median_longer or 'never'}")
    print(f"zb-auto generation: median {1e3 * statistics.median(times):.1f} ms, max {1e3 * max(times):.1f} ms")


if __name__ == "__main__":
    main()
