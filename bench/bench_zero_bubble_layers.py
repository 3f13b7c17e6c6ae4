"""Zero bubble for layers torchpp did not write: pipeline stages of nn.TransformerEncoderLayer
(plain nn.Linear and nn.MultiheadAttention inside), p=2 gloo ranks on CPU, every comparison
within one run, the engines or schedules alternating step by step.

  1. Real bubble: torchpp's zb-h1 (the stages' linears swapped onto the split B/W op, the
     default under schedules with W passes), zb-h1 with ``split_bw=False`` (W passes empty:
     the whole backward in I) and 1f1b, same model and batch. Bubble ratio of each step from
     its measured timeline (``torchpp.pipeline.trace.measured_simulation``: longest rank span
     minus the busiest rank's compute, over that span), and the paired step-time ratio against
     1f1b.
  2. Step time against torch.distributed.pipelining, same model (torch splits any module's
     backward through autograd): torchpp zb-h1 vs torch's ScheduleInterleavedZeroBubble with
     the same single stage per rank (torch has no single-stage ZB class; with one stage per
     rank it runs its zero-bubble order on the same layout), torchpp zb-v vs torch's
     ScheduleZBVZeroBubble and torchpp interleaved-zb vs torch's ScheduleInterleavedZeroBubble
     (two stages per rank, half the layers each).
  3. The swap's own cost, one process: forward + backward of one stage with its layers plain
     vs swapped (I then W), alternating.
  4. What it used to cost (issue 36): ``F.linear`` below autograd (where the split op's forward
     runs) on the transposed (sequence, batch, width) view that ``nn.MultiheadAttention`` feeds
     its input projection, against the same input as rows x features.

    PYTHONPATH=. python bench/bench_zero_bubble_layers.py [--repeats 20] [--m 8] [--no-pin] [--sections 1234] [--p 2]

With ``--p 4`` every stage holds one layer (4 layers in all) and the four ranks share the
machine's cores (rank r pinned to core r mod cores).
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from bench_pipeline import fmt, paired_ratio, summary, timed_step, timed_step_local

P = 2
WIDTH, HEADS, FFN, SEQ, LAYERS = 256, 4, 1024, 64, 4  # LAYERS over the whole model
MB_ROWS = 2  # sequences per microbatch
# (label, torchpp schedule, torch class, stages per rank, placement)
PAIRS = [
    ("zb-h1 vs torch ZB, 1 stage/rank", "zb-h1", "ScheduleInterleavedZeroBubble", 1, "single"),
    ("zb-v vs torch ZBV, 2 stages/rank", "zb-v", "ScheduleZBVZeroBubble", 2, "v"),
    ("interleaved-zb vs torch interleaved ZB, 2 stages/rank", "interleaved-zb", "ScheduleInterleavedZeroBubble", 2,
     "loop"),
]


def stage_ids(rank: int, per_rank: int, placement: str):
    return {"single": [rank], "loop": [rank, rank + P], "v": [rank, 2 * P - 1 - rank]}[placement]


def stage_module(stage: int, num_stages: int) -> nn.Module:
    """Stage ``stage`` of the model: its share of LAYERS encoder layers (seeded by stage)."""
    torch.manual_seed(stage)
    return nn.Sequential(*[nn.TransformerEncoderLayer(WIDTH, HEADS, FFN, dropout=0.0, batch_first=True)
                           for _ in range(LAYERS // num_stages)])


def batch(m: int):
    g = torch.Generator().manual_seed(0)
    return torch.randn(m * MB_ROWS, SEQ, WIDTH, generator=g), torch.randn(m * MB_ROWS, SEQ, WIDTH, generator=g)


def torchpp_step_fn(name, m, ids, num_stages, group, split_bw=None):
    from torchpp.pipeline import PipelineStage, build_schedule

    stages = [PipelineStage(stage_module(s, num_stages), s, num_stages, "cpu", group=group, split_bw=split_bw)
              for s in ids]
    sched = build_schedule(name, stages, m, loss_fn=F.mse_loss)
    x, y = batch(m)
    return (lambda: sched.step(x, target=y)), sched


def torch_step_fn(cls_name, m, ids, num_stages, group):
    from torch.distributed import pipelining as tpp

    stages = [tpp.PipelineStage(stage_module(s, num_stages), s, num_stages, torch.device("cpu"), group=group)
              for s in ids]
    sched = getattr(tpp, cls_name)(stages, m, loss_fn=F.mse_loss)
    x, y = batch(m)
    first, last = 0 in ids, num_stages - 1 in ids

    def step():
        if first:
            sched.step(x, target=y if last else None)
        elif last:
            sched.step(target=y)
        else:
            sched.step()
    return step


def bench_bubble(rank, repeats, m, group):
    """Section 1: per variant, the measured bubble ratios and wall times of its steps."""
    from torchpp.pipeline.trace import gather_runs, measured_simulation

    variants = {"zb-h1": torchpp_step_fn("zb-h1", m, [rank], P, group),
                "zb-h1 split_bw=False": torchpp_step_fn("zb-h1", m, [rank], P, group, split_bw=False),
                "1f1b": torchpp_step_fn("1f1b", m, [rank], P, group)}
    bubble = {k: [] for k in variants}
    wall = {k: [] for k in variants}
    w_share = {k: [] for k in variants}
    order = list(variants)
    for k in range(repeats + 2):  # the first two rounds warm up
        for key in order if k % 2 == 0 else order[::-1]:
            step, sched = variants[key]
            elapsed = timed_step(step)[0]
            sim = measured_simulation(sched, gather_runs(sched, group))
            if k >= 2:
                wall[key].append(elapsed)
                bubble[key].append(sim.bubble_ratio)
                busy = sum(end - start for line in sim.timeline for *_x, start, end in line)
                w_share[key].append(sum(end - start for line in sim.timeline
                                        for _a, kind, _s, _m, start, end in line if kind == "W") / busy)
    modules = variants["zb-h1"][1].stages[0].split_bw_modules
    return {"bubble": bubble, "wall": wall, "w_share": w_share, "split_modules": len(modules)}


def bench_pairs(rank, repeats, m, group):
    """Section 2: per pair, wall times of torchpp's and torch's steps, alternating."""
    rows = []
    for label, name, cls_name, per_rank, placement in PAIRS:
        ids = stage_ids(rank, per_rank, placement)
        num_stages = P * per_rank
        ours, _ = torchpp_step_fn(name, m, ids, num_stages, group)
        theirs = torch_step_fn(cls_name, m, ids, num_stages, group)
        wall = {"ours": [], "theirs": []}
        engines = (("ours", ours), ("theirs", theirs))
        for k in range(repeats + 2):
            for key, fn in engines if k % 2 == 0 else engines[::-1]:
                elapsed = timed_step(fn)[0]
                if k >= 2:
                    wall[key].append(elapsed)
        rows.append({"label": label, "wall": wall})
    return rows


def bench_swap_cost(repeats):
    """Section 3: one stage's forward and backward, plain layers vs swapped (I, then W)."""
    from torchpp.pipeline import weight_grad_store
    from torchpp.pipeline.split_modules import split_linears

    plain, swapped = stage_module(0, P), stage_module(0, P)
    split_linears(swapped)
    x = torch.randn(MB_ROWS, SEQ, WIDTH, requires_grad=True)
    g = torch.randn(MB_ROWS, SEQ, WIDTH)

    def run_plain():
        plain(x).backward(g)

    def run_swapped():
        out = swapped(x)
        with weight_grad_store.capture(0, 0):
            out.backward(g)
        weight_grad_store.run(0, 0)

    times = {"plain": [], "swapped": [], "plain cpu": [], "swapped cpu": []}
    pair = (("plain", run_plain), ("swapped", run_swapped))
    for k in range(repeats + 3):
        for key, fn in pair if k % 2 == 0 else pair[::-1]:
            elapsed, cpu, _ = timed_step_local(fn)
            if k >= 3:
                times[key].append(elapsed)
                times[f"{key} cpu"].append(cpu)
    return times


def bench_transposed_linear(repeats):
    """Section 4: thread CPU seconds of the attention input projection's GEMM, as the split op's
    forward used to run it (a 3-D transposed view: matmul broadcasts the weight into a batched
    GEMM when nothing requires grad) and as it runs now (rows x features)."""
    x = torch.randn(MB_ROWS, SEQ, WIDTH).transpose(0, 1)
    w, b = torch.randn(3 * WIDTH, WIDTH), torch.randn(3 * WIDTH)
    times = {"3-D view": [], "rows": []}
    pair = (("3-D view", lambda: F.linear(x, w, b)), ("rows", lambda: F.linear(x.reshape(-1, WIDTH), w, b)))
    with torch.no_grad():
        for k in range(repeats + 3):
            for key, fn in pair if k % 2 == 0 else pair[::-1]:
                cpu = timed_step_local(fn)[1]
                if k >= 3:
                    times[key].append(cpu)
    return times


def worker(rank, init_file, args, results):
    global P
    P = args.p  # a spawned process starts from the module's default
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    if args.pin:  # rank r on core r, as a launcher binds ranks
        os.sched_setaffinity(0, {rank % os.cpu_count()})
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=P,
                            timeout=datetime.timedelta(seconds=300))
    import torchpp  # noqa: F401

    group = dist.group.WORLD
    out = {}
    if "1" in args.sections:
        out["bubble"] = bench_bubble(rank, args.repeats, args.m, group)
    if "2" in args.sections:
        out["pairs"] = bench_pairs(rank, args.repeats, args.m, group)
    if "3" in args.sections and rank == 0:
        out["swap"] = bench_swap_cost(args.repeats * 2)
    if "4" in args.sections and rank == 0:
        out["transposed"] = bench_transposed_linear(args.repeats * 10)
    results.put((rank, out))
    dist.barrier()
    dist.destroy_process_group()


def print_bubble(per_rank, m):
    res = per_rank[0]["bubble"]  # the ratio is the pipeline's, the same on every rank
    print(f"1. real bubble, p={P}, m={m}, {LAYERS} x nn.TransformerEncoderLayer({WIDTH}, {HEADS}, {FFN}) over "
          f"{P} stages, microbatch {MB_ROWS} x {SEQ} tokens; {res['split_modules']} modules of stage 0 on the split "
          "op under zb-h1; median [p10, p90] over the steps")
    print("| schedule | measured bubble ratio | W share of compute | step (rank 0) | paired step ratio vs 1f1b |\n"
          "|---|---|---|---|---|")
    for key in res["bubble"]:
        ratio = paired_ratio(res["wall"][key], res["wall"]["1f1b"])
        print(f"| {key} | {fmt(summary(res['bubble'][key]), 1, '')} | {fmt(summary(res['w_share'][key]), 1, '')} | "
              f"{fmt(summary(res['wall'][key]))} | {fmt(ratio, 1, '')} |")


def print_pairs(per_rank, m):
    print(f"\n2. step time, torchpp vs torch.distributed.pipelining, same model, m={m} (rank 0's wall clock)")
    print("| pair | torchpp | torch | paired ratio torchpp/torch |\n|---|---|---|---|")
    for row in per_rank[0]["pairs"]:
        ratio = paired_ratio(row["wall"]["ours"], row["wall"]["theirs"])
        print(f"| {row['label']} | {fmt(summary(row['wall']['ours']))} | {fmt(summary(row['wall']['theirs']))} | "
              f"{fmt(ratio, 1, '')} |")


def print_swap(times):
    ratio = paired_ratio(times["swapped"], times["plain"])
    cpu_ratio = paired_ratio(times["swapped cpu"], times["plain cpu"])
    print(f"\n3. one stage ({LAYERS // P} layers), forward + backward of one microbatch, one process: plain "
          f"{fmt(summary(times['plain']))}, swapped (I then W) {fmt(summary(times['swapped']))}, paired ratio "
          f"{fmt(ratio, 1, '')}; on the thread's CPU time (not counting time the busy machine gave to others): "
          f"plain {fmt(summary(times['plain cpu']))}, swapped {fmt(summary(times['swapped cpu']))}, paired ratio "
          f"{fmt(cpu_ratio, 1, '')}")


def main():
    global P
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--m", type=int, default=8, help="microbatches per step")
    parser.add_argument("--no-pin", dest="pin", action="store_false", help="do not bind rank r to core r")
    parser.add_argument("--sections", default="1234")
    parser.add_argument("--p", type=int, default=P, help="pipeline ranks (LAYERS must divide into their stages)")
    args = parser.parse_args()
    P = args.p
    started = time.ctime()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=worker, args=(r, os.path.join(tmp, "store"), args, results)) for r in range(P)]
        for proc in procs:
            proc.start()
        per_rank = dict(results.get() for _ in procs)
        for proc in procs:
            proc.join()
    per_rank = [per_rank[r] for r in range(P)]
    print(f"started {started}, load average at the end {os.getloadavg()}, torch {torch.__version__}\n")
    if "1" in args.sections:
        print_bubble(per_rank, args.m)
    if "2" in args.sections:
        print_pairs(per_rank, args.m)
    if "3" in args.sections:
        print_swap(per_rank[0]["swap"])
    if "4" in args.sections:
        times = per_rank[0]["transposed"]
        print(f"\n4. attention's input projection ({SEQ} x {MB_ROWS} x {WIDTH} -> {3 * WIDTH}), below autograd, thread "
              f"CPU: on the transposed 3-D view {fmt(summary(times['3-D view']))}, as rows x features "
              f"{fmt(summary(times['rows']))}, paired ratio {fmt(paired_ratio(times['3-D view'], times['rows']), 1, '')}")


if __name__ == "__main__":
    main()
