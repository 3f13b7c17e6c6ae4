"""Data parallelism: how much of the gradient all-reduce torchpp hides behind backward, and
how much Adam state ZeRO-1 saves, each against PyTorch's own (DDP, ZeroRedundancyOptimizer).

    torchrun --standalone --nproc-per-node 2 bench/bench_dp.py

Overlap: step time (forward + backward + reduction) of a GPT with
  compute   no reduction at all (the floor),
  serial    torchpp's reducer with every bucket launched after backward (no overlap),
  overlap   torchpp's reducer launching buckets as their gradients become final,
  ddp       torch.nn.parallel.DistributedDataParallel (bucketed, overlapped: the peer).
hidden = (serial - overlap) / (serial - compute): the share of the reduction hidden.
Memory: bytes of Adam state per rank, torch.optim.AdamW vs torchpp's ZeRO-1 vs torch's
ZeroRedundancyOptimizer (which shards whole parameters, so its split is lumpier).
"""
import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
from torch.nn.parallel import DistributedDataParallel

from torchpp.models.gpt import GPT, GPTConfig, gpt_loss
from torchpp.parallel import GradReducer, ZeroRedundancyOptimizer


def state_bytes(optimizer):
    return sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    alone = dist.new_subgroups(group_size=1)[0]  # this rank alone: the reference
    config = GPTConfig(vocab_size=512, hidden_size=args.hidden, num_heads=8, num_layers=args.layers, max_seq_len=args.seq)
    tokens = torch.randint(0, 512, (args.batch, args.seq))

    def make():
        torch.manual_seed(0)
        return GPT(config, group=alone)

    models = {"compute": make(), "serial": make(), "overlap": make()}
    reducers = {
        "serial": GradReducer(models["serial"].parameters(), dist.group.WORLD, accumulations_per_step=0),
        "overlap": GradReducer(models["overlap"].parameters(), dist.group.WORLD, accumulations_per_step=1),
    }
    ddp = DistributedDataParallel(make())

    def run(name):
        def step():
            if name == "ddp":
                ddp.zero_grad()
                gpt_loss(ddp(tokens), tokens, alone).backward()
                return
            model = models[name]
            if name in reducers:
                reducers[name].zero_grad()
            else:
                model.zero_grad()
            gpt_loss(model(tokens), tokens, alone).backward()
            if name in reducers:
                reducers[name].finish()
        return step

    samples = {name: [] for name in ("compute", "serial", "overlap", "ddp")}
    for _ in range(2):  # warm-up
        for name in samples:
            run(name)()
    for _ in range(args.repeats):
        for name in samples:  # interleaved, so machine noise hits all alike
            dist.barrier()
            start = time.perf_counter()
            run(name)()
            samples[name].append(time.perf_counter() - start)
    med = {name: statistics.median(v) for name, v in samples.items()}
    spread = {name: (max(v) - min(v)) / statistics.median(v) for name, v in samples.items()}
    hidden = (med["serial"] - med["overlap"]) / max(med["serial"] - med["compute"], 1e-9)
    if rank == 0:
        params = sum(p.numel() for p in models["compute"].parameters())
        print(f"world={dist.get_world_size()} params={params} repeats={args.repeats} (median ms, spread)")
        for name in samples:
            print(f"  {name:8s} {med[name] * 1e3:9.1f} ms  spread {spread[name]:.2f}")
        print(f"  reduction hidden by overlap: {hidden:.0%}   step ratio torchpp-overlap / ddp: {med['overlap'] / med['ddp']:.2f}")

    # ---- ZeRO-1 memory: one Adam step on each, then count state bytes ----
    results = {}
    for name in ("adamw", "torchpp-zero1", "torch-zero"):
        model = make()
        if name == "adamw":
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        elif name == "torchpp-zero1":
            optimizer = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, dist.group.WORLD, lr=1e-3)
        else:
            optimizer = TorchZero(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)
        gpt_loss(model(tokens), tokens, alone).backward()
        optimizer.step()
        results[name] = state_bytes(optimizer.optimizer if name == "torchpp-zero1" else optimizer)
        if name == "torch-zero":
            results[name] = state_bytes(optimizer.optim)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    if rank == 0:
        print("Adam state bytes per rank (rank 0 .. n-1):")
        for name in results:
            per_rank = [g[name] for g in gathered]
            print(f"  {name:14s} {per_rank}  max/unsharded = {max(per_rank) / gathered[0]['adamw']:.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
