"""torchpp demo: train a small GPT with tensor parallelism (+ sequence parallelism) on CPU.

    torchrun --nproc-per-node 4 examples/train_ptdp.py          # tp=2 x dp=2
    torchrun --nproc-per-node 2 examples/train_ptdp.py --tp 2   # tp=2

Ranks are laid out TP-fastest (Megatron's order): ranks 2k and 2k+1 share a TP group, and
replicas with the same TP rank form a data-parallel group. The task is synthetic and
learnable (arithmetic progressions modulo the vocabulary), so the loss falls quickly.
"""
import argparse
import datetime
import os
import time

import torch
import torch.distributed as dist

import torchpp.tensor_parallel as tp
from torchpp.models.gpt import GPT, GPTConfig, gpt_loss


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size")
    parser.add_argument("--no-sp", action="store_true", help="disable sequence parallelism")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=1234)
    return parser.parse_args()


def build_groups(tp_size):
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % tp_size:
        raise SystemExit(f"world size {world} is not divisible by --tp {tp_size}")
    tp_group = dp_group = None
    for start in range(0, world, tp_size):
        group = dist.new_group(list(range(start, start + tp_size)))
        if start <= rank < start + tp_size:
            tp_group = group
    for offset in range(tp_size):
        group = dist.new_group(list(range(offset, world, tp_size)))
        if rank % tp_size == offset:
            dp_group = group
    return tp_group, dp_group


def progression_batch(generator, batch, seq, vocab):
    """Sequences counting up from a random start by a random stride in 1..3 (mod vocab):
    inputs and next-token labels of length seq; learnable from the last two tokens."""
    start = torch.randint(0, vocab, (batch, 1), generator=generator)
    stride = torch.randint(1, 4, (batch, 1), generator=generator)
    tokens = (start + stride * torch.arange(seq + 1)) % vocab
    return tokens[:, :-1], tokens[:, 1:]


def main():
    args = parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    torch.set_num_threads(1)
    rank = dist.get_rank()
    tp_group, dp_group = build_groups(args.tp)
    dp_size, dp_rank = dp_group.size(), dist.get_rank(dp_group)
    if args.batch % dp_size:
        raise SystemExit(f"--batch {args.batch} is not divisible by the data-parallel size {dp_size}")
    sequence_parallel = not args.no_sp
    if sequence_parallel and args.seq % args.tp:
        raise SystemExit(f"sequence parallelism needs --seq {args.seq} divisible by --tp {args.tp}")

    tp.model_parallel_manual_seed(args.seed, tp_rank=dist.get_rank(tp_group))
    config = GPTConfig(vocab_size=64, hidden_size=args.hidden, num_heads=4, num_layers=args.layers, max_seq_len=args.seq)
    model = GPT(config, group=tp_group, sequence_parallel=sequence_parallel)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    data = torch.Generator().manual_seed(args.seed + dp_rank)  # each replica its own data

    if rank == 0:
        print(f"world={dist.get_world_size()} tp={args.tp} dp={dp_size} sp={sequence_parallel} "
              f"params/rank={sum(p.numel() for p in model.parameters())}", flush=True)
    for step in range(1, args.steps + 1):
        start = time.perf_counter()
        inputs, labels = progression_batch(data, args.batch // dp_size, args.seq, config.vocab_size)
        loss = gpt_loss(model(inputs), labels, tp_group)
        optimizer.zero_grad(set_to_none=False)
        loss.backward()
        if sequence_parallel:
            tp.allreduce_sequence_parallel_grads(model, tp_group)
        grads = [p.grad for p in model.parameters()]
        flat = torch._utils._flatten_dense_tensors(grads).div_(dp_size)
        dist.all_reduce(flat, group=dp_group)
        for grad, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
            grad.copy_(synced)
        optimizer.step()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss, group=dp_group)
        if rank == 0:
            tokens_per_s = args.batch * args.seq / (time.perf_counter() - start)
            print(f"step {step:3d}  loss {mean_loss.item() / dp_size:.4f}  tokens/s {tokens_per_s:8.0f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
