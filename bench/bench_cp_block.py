"""Context-parallel block attention on fused kernels vs F.scaled_dot_product_attention, one
process: time (forward + backward) and peak memory (beyond the inputs) of

  1. the whole sequence at cp=1 (torchpp.context_parallel.attention on a group of one rank,
     zigzag: three blocks, two causal diagonals and one full) against SDPA on that sequence;
  2. one block at cp=2 sizes (a rank's contiguous shard: one causal diagonal block, and one
     full block) against SDPA on the same shapes.

Each torchpp row runs on the fused kernels (the default: the CPU flash kernel; on CUDA the
kernel SDPA picks, cuDNN on Hopper, flash for fp16/bf16 elsewhere, memory-efficient for fp32),
on CUDA again with flash instead of cuDNN (TORCHPP_CP_KERNEL=flash), and on the matmul + softmax
path that holds each block's scores (TORCHPP_CP_KERNEL=matmul), the path every block took before.

    python bench/bench_cp_block.py            # CUDA: seq 8192, 32 heads of 128, bf16
    python bench/bench_cp_block.py --small    # CPU-sized: seq 2048, 4 heads of 64, fp32
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F

from device_bench import (add_arguments, cpu_allocations_returned, device_of, fmt_ms, median_spread, peak_bytes,
                          single_rank_group, time_variants, write_json)


def sizes(args):
    if args.small:
        return dict(batch=1, heads=4, head_dim=64, seq=args.seq or 2048, dtype=torch.float32)
    return dict(batch=1, heads=32, head_dim=128, seq=args.seq or 8192, dtype=torch.bfloat16)


def inputs(shape, seq, device):
    g = torch.Generator().manual_seed(0)
    make = lambda: torch.randn(shape["batch"], shape["heads"], seq, shape["head_dim"], generator=g)  # noqa: E731
    q, k, v, grad = (make().to(device, shape["dtype"]) for _ in range(4))
    return [t.requires_grad_() for t in (q, k, v)], grad


def sdpa_step(qkv, grad, causal):
    def step():
        for t in qkv:
            t.grad = None
        F.scaled_dot_product_attention(*qkv, is_causal=causal).backward(grad)
    return step


def torchpp_step(qkv, grad, causal, layout, kernel=None):
    """torchpp's attention with its own kernel choice, or with TORCHPP_CP_KERNEL=kernel."""
    import torch.distributed as dist

    from torchpp.context_parallel import attention

    def step():
        for t in qkv:
            t.grad = None
        if kernel:
            os.environ["TORCHPP_CP_KERNEL"] = kernel
        try:
            attention(*qkv, dist.group.WORLD, causal=causal, layout=layout).backward(grad)
        finally:
            os.environ.pop("TORCHPP_CP_KERNEL", None)
    return step


def run_case(label, seq, causal, layout, args, device, shape, rows):
    qkv, grad = inputs(shape, seq, device)
    variants = {"SDPA": sdpa_step(qkv, grad, causal),
                "torchpp fused": torchpp_step(qkv, grad, causal, layout)}
    if device.type == "cuda":  # where SDPA picks cuDNN attention (Hopper), the blocks do too: flash for comparison
        variants["torchpp flash"] = torchpp_step(qkv, grad, causal, layout, kernel="flash")
    variants["torchpp matmul"] = torchpp_step(qkv, grad, causal, layout, kernel="matmul")
    times = time_variants(variants, device, args.repeats)
    peaks = {name: peak_bytes(fn, device) for name, fn in variants.items()}
    base_t, base_m = median_spread(times["SDPA"])[0], peaks["SDPA"]
    for name in variants:
        t = median_spread(times[name])[0]
        ratio_m = f"{peaks[name] / base_m:.2f}" if base_m else "n/a"
        print(f"| {label} | {name} | {fmt_ms(times[name])} | {t / base_t:.2f} | {peaks[name] / 2**20:.1f} | {ratio_m} |")
        rows.append(dict(case=label, variant=name, seq=seq, causal=causal, median_s=t,
                         spread=median_spread(times[name])[1], peak_bytes=peaks[name]))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser, repeats=10)
    parser.add_argument("--seq", type=int, default=None, help="sequence length (default 8192, --small 2048)")
    args = parser.parse_args()
    device = device_of(args)
    if device.type == "cpu":
        cpu_allocations_returned()
    shape = sizes(args)
    single_rank_group(device)
    import torchpp  # noqa: F401  (registers torch.ops.torchpp)

    seq = shape["seq"]
    print(f"context-parallel block attention on {device} ({torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}), "
          f"batch {shape['batch']}, {shape['heads']} heads of {shape['head_dim']}, {shape['dtype']}, "
          f"{args.repeats} repeats; time of forward + backward, peak memory beyond the inputs")
    print("| case | variant | time | time / SDPA | peak MiB | peak / SDPA |\n|---|---|---|---|---|---|")
    rows = []
    run_case(f"seq {seq}, cp=1, causal", seq, True, "zigzag", args, device, shape, rows)
    run_case(f"block at cp=2 ({seq // 2} x {seq // 2}), causal diagonal", seq // 2, True, "contiguous", args, device,
             shape, rows)
    run_case(f"block at cp=2 ({seq // 2} x {seq // 2}), full", seq // 2, False, "contiguous", args, device, shape,
             rows)
    write_json(args, {"bench": "cp_block", "shape": {k: str(v) for k, v in shape.items()}, "rows": rows})


if __name__ == "__main__":
    main()
