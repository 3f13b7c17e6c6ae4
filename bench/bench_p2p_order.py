"""Tagged against in-order P2P on gloo (p=2, rank r pinned to core r), same processes.

The in-order mode is what NCCL needs (one place per message in a global order, see
docs/schedules.md); on gloo it is optional. This prints the step time of each mode and the
median [p10, p90] of the per-pair ratios in-order / tagged, the mode going first alternating.

    PYTHONPATH=. python bench/bench_p2p_order.py [--repeats 40]
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import bench_pipeline as B

CASES = [("1F1B", "1f1b", 1, "single"), ("interleaved 1F1B (v=2)", "interleaved-1f1b", 2, "loop"),
         ("ZB-V", "zb-v", 2, "v")]


def worker(rank, init, repeats, results):
    torch.set_num_threads(1)
    os.sched_setaffinity(0, {rank % os.cpu_count()})
    dist.init_process_group("gloo", init_method="file://" + init, rank=rank, world_size=B.P,
                            timeout=datetime.timedelta(seconds=120))
    rows = []
    for label, name, per_rank, placement in CASES:
        for m in B.STEP_MS:
            ids = B.stage_ids(rank, per_rank, placement)
            steps = {mode: B.torchpp_step_fn(name, B.HIDDEN, m, ids, B.P * per_rank, dist.group.WORLD,
                                             in_order_p2p=mode)[0] for mode in (False, True)}
            for step in steps.values():
                for _ in range(3):
                    B.timed_step(step)
            times, ratios = {False: [], True: []}, []
            for k in range(repeats):
                pair = {}
                for mode in ((False, True) if k % 2 == 0 else (True, False)):
                    pair[mode] = B.timed_step(steps[mode])[0]
                    times[mode].append(pair[mode])
                ratios.append(pair[True] / pair[False])
            rows.append((label, m, statistics.median(times[False]), statistics.median(times[True]), B.summary(ratios)))
    results.put((rank, rows))
    dist.barrier()
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=40)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=worker, args=(r, os.path.join(tmp, "init"), args.repeats, results))
                 for r in range(B.P)]
        for proc in procs:
            proc.start()
        by_rank = dict(results.get() for _ in procs)
        for proc in procs:
            proc.join()
    print("| schedule | m | tagged | in order | ratio in order / tagged |\n|---|---|---|---|---|")
    for label, m, tagged, in_order, (median, p10, p90) in by_rank[0]:
        print(f"| {label} | {m} | {tagged * 1e3:.2f} ms | {in_order * 1e3:.2f} ms | {median:.2f} [{p10:.2f}, {p90:.2f}] |")


if __name__ == "__main__":
    main()
