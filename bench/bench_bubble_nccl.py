"""The real bubble of a p=2 pipeline over NCCL (two ranks sharing the one GPU through
torchpp.testing.one_gpu; gloo on the CPU) against the schedule simulator's prediction from the
same run's measured costs: each stage's median F, I, W (torchpp.pipeline.trace.measured_costs),
with no transfer time and with the measured one-way time of one activation message.

The two ranks time-slice one GPU, so a span stretches while the other rank computes; the
measured costs come from the same run and carry that stretch into the prediction.

    python bench/bench_bubble_nccl.py           # CUDA: stages of 8 x Linear(4096) fp32, 512 rows a microbatch
    python bench/bench_bubble_nccl.py --small   # CPU-sized: 2 x Linear(256), 64 rows
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

from device_bench import add_arguments, device_of, synchronize, write_json

P, M = 2, 8


def sizes(small):
    return (256, 2, 64) if small else (4096, 8, 512)  # width, linears per stage, rows per microbatch


def stage_module(width, depth, seed):
    from torchpp.pipeline import SplitBWLinear

    torch.manual_seed(seed)
    layers = []
    for _ in range(depth):
        layers += [SplitBWLinear(width, width), nn.GELU()]
    return nn.Sequential(*layers)


def one_way_ms(rank, shape, device, repeats=20):
    """Half the median round trip of one activation-sized message between the two ranks."""
    trips = []
    for _ in range(repeats):
        inbox, outbox = torch.empty(shape, device=device), torch.zeros(shape, device=device)
        dist.barrier()
        synchronize(device)
        start = time.perf_counter()
        if rank == 0:
            dist.send(outbox, 1)
            dist.recv(inbox, 1)
        else:
            dist.recv(inbox, 0)
            dist.send(outbox, 0)
        synchronize(device)
        trips.append(time.perf_counter() - start)
    return statistics.median(trips) / 2 * 1e3


def worker(rank, init_file, small, repeats, results):
    from torchpp import schedule as S

    device = torch.device("cpu")
    if not small:
        from torchpp.testing.one_gpu import share_one_gpu

        device = share_one_gpu(rank)
    dist.init_process_group("cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo",
                            init_method=f"file://{init_file}", rank=rank, world_size=P,
                            timeout=datetime.timedelta(seconds=120))
    from torchpp.pipeline import PipelineStage, build_schedule
    from torchpp.pipeline.trace import gather_runs, measured_costs, measured_simulation

    width, depth, rows = sizes(small)
    comm = one_way_ms(rank, (rows, width), device)
    out = {"comm_ms": comm}
    for name in ("zb-h1", "1f1b"):
        stage = PipelineStage(stage_module(width, depth, rank).to(device), rank, P, device)
        sched = build_schedule(name, stage, M, loss_fn=F.mse_loss)
        x = torch.randn(rows * M, width, generator=torch.Generator().manual_seed(1)).to(device)
        measured, predicted, with_comm = [], [], []
        for k in range(repeats + 2):
            dist.barrier()
            sched.step(x if rank == 0 else None, target=x if rank == P - 1 else None)
            runs = gather_runs(sched)
            if k < 2:
                continue  # warm-up: shapes travel, kernels and NCCL's channels start
            sim = measured_simulation(sched, runs)
            costs = measured_costs(sim)
            measured.append(sim.bubble_ratio)
            predicted.append(S.simulate(sched.schedule, **costs).bubble_ratio)
            with_comm.append(S.simulate(sched.schedule, **costs, comm=comm).bubble_ratio)
        out[name] = {"measured": statistics.median(measured), "predicted": statistics.median(predicted),
                     "predicted_with_comm": statistics.median(with_comm),
                     "costs_ms": {k: [round(v, 3) for v in values] for k, values in costs.items()}}
    results.put((rank, out))
    dist.barrier()
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser, repeats=10)
    args = parser.parse_args()
    device = device_of(args)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init_file = os.path.join(tempfile.mkdtemp(prefix="torchpp_bubble_"), "store")
    procs = [ctx.Process(target=worker, args=(r, init_file, args.small, args.repeats, results)) for r in range(P)]
    for proc in procs:
        proc.start()
    out = dict(results.get(timeout=600) for _ in range(P))
    for proc in procs:
        proc.join()
    width, depth, rows = sizes(args.small)
    first = out[0]
    print(f"real bubble at p=2 over {'NCCL, two ranks on one GPU' if device.type == 'cuda' else 'gloo (CPU)'}: "
          f"stages of {depth} x Linear({width}), {rows} rows a microbatch, m={M}, {args.repeats} steps; "
          f"one-way message {first['comm_ms']:.2f} ms")
    print("| schedule | measured bubble ratio | simulated from measured F/I/W | + measured transfer time | "
          "F / I / W ms (stage 0) |\n|---|---|---|---|---|")
    for name in ("zb-h1", "1f1b"):
        row = first[name]
        costs = row["costs_ms"]
        print(f"| {name} | {row['measured']:.3f} | {row['predicted']:.3f} | {row['predicted_with_comm']:.3f} | "
              f"{costs['f'][0]} / {costs['i'][0]} / {costs['w'][0]} |")
    write_json(args, {"bench": "bubble_nccl", "width": width, "depth": depth, "rows": rows, "m": M, "ranks": out})


if __name__ == "__main__":
    main()
