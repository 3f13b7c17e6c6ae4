"""ZeRO stages 0-3 at dp=2: per-rank memory and step time (each against ZeRO-1), and, under a
pipeline, ZeRO-3's gathers per step when kept across microbatches vs resharded after each forward.

    torchrun --standalone --nproc-per-node 2 bench/bench_zero.py            # dp=2
    torchrun --standalone --nproc-per-node 4 bench/bench_zero.py --pp 2     # pp=2 x dp=2, ZeRO-3 only

One GPT (fp32, AdamW) per stage, trained the same way: zero_grad, forward + backward, step.
Memory is what DistributedOptimizer.memory_bytes() counts (allocated storages of parameters,
gradients and optimizer state), sampled twice: after backward (before the step) and after the
step (what a rank holds between steps). Step times are interleaved over the stages, repeats
times, and reported as the median and the spread (max - min) / median.
"""
import argparse

import torch
import torch.distributed as dist

from torchpp.models.gpt import GPT, GPTConfig, gpt_loss

from timing import interleaved, median_spread  # bench/timing.py, next to this script
from torchpp.parallel import DistributedOptimizer, init_parallel


def _mib(nbytes):
    return f"{nbytes / 2**20:7.2f}"


def bench_dp(args, state):
    config = GPTConfig(vocab_size=512, hidden_size=args.hidden, num_heads=8, num_layers=args.layers,
                       max_seq_len=args.seq)
    tokens = torch.randint(0, 512, (args.batch, args.seq), generator=torch.Generator().manual_seed(state.dp_rank))
    runs = {}
    for zero in (0, 1, 2, 3):
        torch.manual_seed(0)
        model = GPT(config, group=state.tp_group)
        optimizer = DistributedOptimizer(model, torch.optim.AdamW, state, zero=zero, lr=1e-4,
                                         bucket_bytes=args.bucket_mib * 2**20)
        runs[zero] = (model, optimizer, {})

    def step(zero):
        model, optimizer, memory = runs[zero]
        optimizer.zero_grad()
        gpt_loss(model(tokens), tokens, state.tp_group).backward()
        memory["after backward"] = optimizer.memory_bytes()
        optimizer.step()
        memory["after step"] = optimizer.memory_bytes()

    samples = interleaved(step, runs, args.repeats)
    if state.dp_rank != 0:
        return
    model_bytes = sum(p.numel() * p.element_size() for p in runs[0][0].parameters())
    print(f"dp={state.dp} GPT h={args.hidden} L={args.layers}: {model_bytes / 2**20:.2f} MiB of parameters; "
          f"bucket {args.bucket_mib} MiB; repeats={args.repeats}; MiB on rank 0")
    print("| zero | params | grads | optimizer | total after step | grads after backward | step ms (median) | spread | vs zero=1 |")
    print("|---|---|---|---|---|---|---|---|---|")
    base = median_spread(samples[1])[0]
    for zero, (_, optimizer, memory) in runs.items():
        after, mid = memory["after step"], memory["after backward"]
        med, spread = median_spread(samples[zero])
        print(f"| {zero} | {_mib(after['param'])} | {_mib(after['grad'])} | {_mib(after['optimizer'])} | "
              f"{_mib(sum(after.values()))} | {_mib(mid['grad'])} | {med * 1e3:.1f} | {spread:.2f} | {med / base:.2f} |")


def bench_pp(args, state):
    """pp=2 x dp=2, 1F1B over args.microbatches: ZeRO-3 kept gathered vs resharded per forward."""
    from torchpp.pipeline import PipelineStage, build_schedule, split_model

    config = GPTConfig(vocab_size=512, hidden_size=args.hidden, num_heads=8, num_layers=args.layers,
                       max_seq_len=args.seq)
    tokens = torch.randint(0, 512, (args.batch * args.microbatches, args.seq),
                           generator=torch.Generator().manual_seed(state.dp_rank))
    runs = {}
    for name, reshard in (("kept", False), ("resharded per forward", True)):
        torch.manual_seed(0)
        part = split_model(GPT(config, group=state.tp_group), state.pp)[state.pp_rank]
        stage = PipelineStage(part, state.pp_rank, state.pp, torch.device("cpu"), group=state.pp_group)
        pipeline = build_schedule("1f1b", [stage], args.microbatches,
                                  loss_fn=lambda out, target: gpt_loss(out, target, state.tp_group))
        optimizer = DistributedOptimizer(part, torch.optim.AdamW, state, zero=3, lr=1e-4,
                                         accumulations_per_step=args.microbatches, bucket_bytes=args.bucket_mib * 2**20,
                                         reshard_after_forward=reshard)
        runs[name] = (pipeline, optimizer, {})

    def step(name):
        pipeline, optimizer, info = runs[name]
        optimizer.zero_grad()
        before = optimizer.optimizer.gathers
        optimizer.optimizer.gathered_buckets.peak = 0
        pipeline.step(*([tokens] if state.pp_rank == 0 else []), target=tokens if state.pp_rank == state.pp - 1 else None)
        info["gathers"] = optimizer.optimizer.gathers - before
        info["buckets"] = len(optimizer.optimizer.flat_groups)
        info["peak"] = optimizer.optimizer.gathered_buckets.peak
        optimizer.step()

    samples = interleaved(step, runs, args.repeats)
    if dist.get_rank() != 0:
        return
    print(f"pp={state.pp} x dp={state.dp}, 1F1B, {args.microbatches} microbatches; rank 0 (first stage)")
    print("| ZeRO-3 | bucket gathers per step | buckets | most gathered at once | step ms (median) | spread |")
    print("|---|---|---|---|---|---|")
    for name, (_, _, info) in runs.items():
        med, spread = median_spread(samples[name])
        print(f"| {name} | {info['gathers']} | {info['buckets']} | {info['peak']} | {med * 1e3:.1f} | {spread:.2f} |")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--bucket-mib", type=float, default=1.0)
    args = parser.parse_args()
    state = init_parallel(tp=1, pp=args.pp)
    torch.set_num_threads(1)
    (bench_pp if args.pp > 1 else bench_dp)(args, state)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
