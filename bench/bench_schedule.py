"""Schedule compiler speed: zb-auto at p=16, m=128 (generate + lower + simulate, target < 100 ms)
and, in the same run, torchpp against torch.distributed.pipelining's own schedule generation
for the schedules both have (torch builds the per-rank order and its lowered form with
communication when a schedule object is constructed; we time generate + lower).

    PYTHONPATH=. python bench/bench_schedule.py [--pp 16] [--microbatches 128] [--repeats 15]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.distributed.pipelining import schedules as torch_schedules

from torchpp import schedule as S


class _Stage:
    """Just what torch's schedule constructors read from a stage: no process group needed."""

    def __init__(self, index: int, num_stages: int, group_size: int, rank: int):
        self.stage_index, self.num_stages = index, num_stages
        self.group_size, self.group_rank = group_size, rank
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        self.submod = torch.nn.Identity()
        self.stage_index_to_group_rank = {}


def torch_builder(cls, p: int, m: int, placement: str):
    """Constructs rank 0's torch schedule; the constructor computes every rank's order."""
    if placement == "single":
        return lambda: cls(_Stage(0, p, p, 0), m)
    ids = [0, 2 * p - 1] if placement == "v" else [0, p]
    return lambda: cls([_Stage(i, 2 * p, p, 0) for i in ids], m)


# (torchpp name, num_chunks, torch class, placement)
SHARED = [
    ("gpipe", None, torch_schedules.ScheduleGPipe, "single"),
    ("1f1b", None, torch_schedules.Schedule1F1B, "single"),
    ("interleaved-1f1b", 2, torch_schedules.ScheduleInterleaved1F1B, "loop"),
    ("looped-bfs", 2, torch_schedules.ScheduleLoopedBFS, "loop"),
    ("zb-v", None, torch_schedules.ScheduleZBVZeroBubble, "v"),
    ("dualpipe-v", None, torch_schedules.ScheduleDualPipeV, "v"),
]


def measure(fn, repeats: int) -> list[float]:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def summary(times: list[float]) -> str:
    """Median and spread, the spread being (max - min) / median as docs/benchmarks.md reads it."""
    median = statistics.median(times)
    return f"{median:8.2f} ms spread {(max(times) - min(times)) / median:5.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pp", type=int, default=16)
    parser.add_argument("--microbatches", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    p, m, n = args.pp, args.microbatches, args.repeats
    print(f"torch {torch.__version__}, p={p}, m={m}, {n} repeats; median and spread of wall time\n")

    def zb_auto():
        sch = S.generate("zb-auto", p, m, costs=(1.0, 1.0, 1.0, 0.0))
        sch.lowered()
        return S.simulate(sch)

    times = measure(zb_auto, n)
    sim = zb_auto()
    verdict = "under" if statistics.median(times) < 100 else "OVER"
    print(f"zb-auto generate+lower+simulate {summary(times)}  -> {verdict} 100 ms; bubble ratio {sim.bubble_ratio:.4f}\n")

    print(f"{'schedule':18} {'torchpp generate+lower':>26} {'torch construction':>26} {'torchpp/torch':>14}")
    for name, chunks, cls, placement in SHARED:
        ours = measure(lambda: S.generate(name, p, m, num_chunks=chunks).lowered(), n)
        theirs = measure(torch_builder(cls, p, m, placement), n)
        ours += measure(lambda: S.generate(name, p, m, num_chunks=chunks).lowered(), n)  # before and after torch: drift hits both
        ratio = statistics.median(ours) / statistics.median(theirs)
        print(f"{name:18} {summary(ours):>26} {summary(theirs):>26} {ratio:14.4f}")


if __name__ == "__main__":
    main()
