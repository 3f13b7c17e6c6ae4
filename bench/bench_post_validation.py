"""Optimizer post-validation against synchronous clipping: time per training step under ZB-H2.

    torchrun --nproc-per-node 2 bench/bench_post_validation.py [--blocks 20] [--steps 8]

p=2 gloo ranks, one thread each; stages of 2 x SplitBWLinear(width) + GELU, m=8 microbatches,
AdamW with max_norm far above the gradients' norm (clipping never triggers: the common case,
which post-validation speeds up; a redo costs a step more). The two setups (same model, same
data) alternate in blocks of --steps steps with no barrier inside a block, so a rank may start
its next step while the other finishes its last: that overlap is what the synchronous clip's
all-reduce prevents. Per block: wall time per step of the slower rank; reported: median
[p10, p90] per setup and of the per-pair ratio post-validated / synchronous.
"""
import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

import torchpp
from torchpp.parallel import DistributedOptimizer
from torchpp.pipeline import PipelineStage, SplitBWLinear, build_schedule

M = 8


def setup(state, width, rows, post_validate):
    torch.manual_seed(state.pp_rank)
    stage_module = nn.Sequential(SplitBWLinear(width, width), nn.GELU(), SplitBWLinear(width, width))
    stage = PipelineStage(stage_module, state.pp_rank, state.pp, "cpu", group=state.pp_group)
    schedule = build_schedule("zb-h2", stage, M, loss_fn=lambda out, target: ((out - target) ** 2).mean())
    optimizer = DistributedOptimizer(stage_module.parameters(), torch.optim.AdamW, state, max_norm=1e6,
                                     accumulations_per_step=M, post_validate=post_validate, lr=1e-4)
    x, y = torch.randn(rows * M, width), torch.randn(rows * M, width)

    def step():
        optimizer.zero_grad()
        schedule.step(x, target=y)
        optimizer.step()
        assert not optimizer.rerun

    return step, optimizer


def block_time(step, steps, flush=None):
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    if flush is not None:
        flush()  # the last update of the block is settled inside the timed span
    elapsed = torch.tensor(time.perf_counter() - start)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item() / steps


def quantiles(values):
    q = statistics.quantiles(values, n=10)
    return statistics.median(values), q[0], q[-1]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=20)
    parser.add_argument("--steps", type=int, default=8, help="steps per block")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--rows", type=int, default=32, help="rows per microbatch")
    args = parser.parse_args()
    torch.set_num_threads(1)
    state = torchpp.init_parallel(tp=1, pp=2)
    sync_step, _ = setup(state, args.width, args.rows, post_validate=False)
    post_step, post_optimizer = setup(state, args.width, args.rows, post_validate=True)
    for _ in range(2):  # warm-up
        sync_step()
        post_step()
    post_optimizer.flush()
    sync_times, post_times, ratios = [], [], []
    for block in range(args.blocks):
        order = [("sync", sync_step, None), ("post", post_step, post_optimizer.flush)]
        if block % 2:
            order.reverse()  # which goes first alternates from pair to pair
        times = {name: block_time(step, args.steps, flush) for name, step, flush in order}
        sync_times.append(times["sync"])
        post_times.append(times["post"])
        ratios.append(times["post"] / times["sync"])
    if state.pp_rank == 0:
        s, p, r = quantiles(sync_times), quantiles(post_times), quantiles(ratios)
        print(f"zb-h2 p=2 m={M} width={args.width} rows={args.rows}, {args.blocks} blocks of {args.steps} steps")
        print(f"synchronous clip   {s[0] * 1e3:8.2f} ms/step [{s[1] * 1e3:.2f}, {s[2] * 1e3:.2f}]")
        print(f"post-validation    {p[0] * 1e3:8.2f} ms/step [{p[1] * 1e3:.2f}, {p[2] * 1e3:.2f}]")
        print(f"ratio post / sync  {r[0]:8.3f} [{r[1]:.3f}, {r[2]:.3f}]")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
