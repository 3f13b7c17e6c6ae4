"""TP mapping ops and a Megatron MLP block: torchpp's C++ ops vs plain PyTorch.

The peer is what a Megatron-style codebase writes without torchpp: Python
torch.autograd.Functions calling torch.distributed collectives. Both run in the same
processes on the same tensors; the script prints per-op medians, spreads and the ratio
torchpp / plain (below 1 is faster). torchpp is also timed with its shape check before each
gloo collective turned off (torchpp.O.set_collective_checks(False)), interleaved, and the
ratio checked / unchecked is the check's cost.

    torchrun --standalone --nproc-per-node 2 bench/bench_tp_ops.py
"""
import argparse
import statistics
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

import torchpp.ops as O


class _PlainCopy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


class _PlainReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


class _PlainGatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        out = torch.empty((x.shape[0] * dist.get_world_size(),) + x.shape[1:], dtype=x.dtype)
        dist.all_gather_into_tensor(out, x.contiguous())
        return out

    @staticmethod
    def backward(ctx, grad):
        out = torch.empty((grad.shape[0] // dist.get_world_size(),) + grad.shape[1:], dtype=grad.dtype)
        dist.reduce_scatter_tensor(out, grad.contiguous())
        return out


class _PlainReduceScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _PlainGatherSeq.backward(ctx, x)

    @staticmethod
    def backward(ctx, grad):
        return _PlainGatherSeq.forward(ctx, grad)


def time_it(fn, repeats, warmup=3):
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return samples


def summary(samples):
    median = statistics.median(samples)
    return median, (max(samples) - min(samples)) / median


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    args = parser.parse_args()
    warnings.filterwarnings("ignore", category=FutureWarning)  # the peer uses the long-standing collective names
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    world = dist.get_world_size()
    s, b, h = args.seq, args.batch, args.hidden
    x = torch.randn(s, b, h, requires_grad=True)
    x_local = torch.randn(s // world, b, h, requires_grad=True)
    w1 = (torch.randn(4 * h // world, h) * 0.02).requires_grad_()
    w2 = (torch.randn(h, 4 * h // world) * 0.02).requires_grad_()

    cases = {
        "copy_to_tp_region f+b": (lambda: O.copy_to_tp_region(x).sum().backward(), lambda: _PlainCopy.apply(x).sum().backward()),
        "reduce_from_tp_region f+b": (lambda: O.reduce_from_tp_region(x).sum().backward(), lambda: _PlainReduce.apply(x).sum().backward()),
        "gather_from_sp_region f+b": (
            lambda: O.gather_from_sp_region(x_local).sum().backward(),
            lambda: _PlainGatherSeq.apply(x_local).sum().backward(),
        ),
        "MLP block (TP) f+b": (
            lambda: O.reduce_from_tp_region(F.linear(F.gelu(F.linear(O.copy_to_tp_region(x), w1)), w2)).sum().backward(),
            lambda: _PlainReduce.apply(F.linear(F.gelu(F.linear(_PlainCopy.apply(x), w1)), w2)).sum().backward(),
        ),
        "MLP block (TP+SP) f+b": (
            lambda: O.reduce_scatter_to_sp_region(F.linear(F.gelu(F.linear(O.gather_from_sp_region(x_local), w1)), w2)).sum().backward(),
            lambda: _PlainReduceScatterSeq.apply(F.linear(F.gelu(F.linear(_PlainGatherSeq.apply(x_local), w1)), w2)).sum().backward(),
        ),
    }
    if dist.get_rank() == 0:
        print(f"world={world} s={s} b={b} h={h} repeats={args.repeats} (median, spread=(max-min)/median)")
        print(f"{'case':28s} {'torchpp ms':>11s} {'spread':>7s} {'plain ms':>9s} {'spread':>7s} {'ratio':>6s} "
              f"{'unchecked ms':>13s} {'spread':>7s} {'checked/unchecked':>18s}")
    for name, (ours, plain) in cases.items():
        # Interleave the three so drift on a noisy machine hits all alike.
        mine, theirs, unchecked = [], [], []
        for _ in range(3):
            mine += time_it(ours, args.repeats // 3)
            theirs += time_it(plain, args.repeats // 3)
            O.set_collective_checks(False)
            unchecked += time_it(ours, args.repeats // 3)
            O.set_collective_checks(True)
        (m_med, m_spread), (p_med, p_spread), (u_med, u_spread) = summary(mine), summary(theirs), summary(unchecked)
        if dist.get_rank() == 0:
            print(f"{name:28s} {m_med * 1e3:11.3f} {m_spread:7.2f} {p_med * 1e3:9.3f} {p_spread:7.2f} {m_med / p_med:6.2f} "
                  f"{u_med * 1e3:13.3f} {u_spread:7.2f} {m_med / u_med:18.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
