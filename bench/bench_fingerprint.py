"""Cost of the schedule fingerprint that every step's start vote carries (issue 27): the same
pipeline (p=2 gloo ranks, 1f1b, stages of nn.Linear) stepped by two schedules alternating step
by step, one with the fingerprint and one with it emptied (an empty fingerprint matches any, so
the vote carries nothing extra). Small layers, so that a per-step overhead is as visible as it
gets; median [p10, p90] of rank 0's step time and of the paired ratio.

    PYTHONPATH=. python bench/bench_fingerprint.py [--repeats 200] [--width 64]
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

P, M = 2, 8


def _quantiles(values):
    values = sorted(values)
    pick = lambda q: values[min(len(values) - 1, int(q * (len(values) - 1) + 0.5))]  # noqa: E731
    return statistics.median(values), pick(0.1), pick(0.9)


def _worker(rank: int, init: str, repeats: int, width: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=P,
                            timeout=datetime.timedelta(seconds=300))
    from torchpp.pipeline import PipelineStage, build_schedule
    from torchpp.pipeline.schedules import PipelineSchedule

    def schedule(fingerprint: bool):
        torch.manual_seed(0)
        stage = PipelineStage(nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width)),
                              rank, P, "cpu")
        original = PipelineSchedule._fingerprint
        if not fingerprint:
            PipelineSchedule._fingerprint = lambda self, lowered: []
        try:
            sched = build_schedule("1f1b", stage, M, loss_fn=nn.functional.mse_loss)
            x, y = torch.randn(4 * M, width), torch.randn(4 * M, width)
            sched.step(x, target=y)  # the executor (and its fingerprint) is built at the first step
        finally:
            PipelineSchedule._fingerprint = original
        return sched, x, y

    runs = {"with fingerprint": schedule(True), "fingerprint emptied": schedule(False)}
    times = {name: [] for name in runs}
    for _ in range(repeats):
        for name, (sched, x, y) in runs.items():
            dist.barrier()
            start = time.perf_counter()
            sched.step(x, target=y)
            times[name].append((time.perf_counter() - start) * 1e3)
    if rank == 0:
        base = times["fingerprint emptied"]
        with open(out, "w") as f:
            for name, values in times.items():
                ratio = [t / b for t, b in zip(values, base)]
                med, lo, hi = _quantiles(values)
                rmed, rlo, rhi = _quantiles(ratio)
                f.write(f"| {name} | {med:.3f} ms [{lo:.3f}, {hi:.3f}] | {rmed:.3f} [{rlo:.3f}, {rhi:.3f}] |\n")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--width", type=int, default=64)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.md")
        mp.spawn(_worker, args=(f"file://{os.path.join(tmp, 'rendezvous')}", args.repeats, args.width, out),
                 nprocs=P, join=True)
        print(f"p={P}, 1f1b, m={M}, stages Linear({args.width}) x 2, {args.repeats} paired steps; median [p10, p90]")
        print("| schedule | step (rank 0) | paired ratio vs emptied |\n|---|---|---|")
        print(open(out).read(), end="")


if __name__ == "__main__":
    main()
