"""Linear recurrences over a sequence split across cp ranks: the gated delta rule (Qwen3.5's
linear attention) or, with ``--scan selective``, Mamba-1's selective scan.

    torchrun --standalone --nproc-per-node 2 bench/bench_cp_recurrences.py [--scan selective --seq 2048]

One forward + backward of transformers' own chunked delta rule (Qwen3.5's
torch_chunk_gated_delta_rule, float32), sharded by torchpp.context_parallel.delta_rule at cp =
world size (each rank runs its chunks on values widened by d_k columns, then composes the states
entering them from every chunk's all-gathered map), against the same rule on the whole sequence
in one process (the peer: what each rank would run without cp). The selective scan likewise:
transformers' mamba_selective_scan (Mamba's torch path, float32) sharded by
torchpp.context_parallel.selective_scan (each rank scans its chunks from zero, then adds the
states entering them, composed from every chunk's all-gathered decay and last state). One thread
per rank; repeats interleaved; median and spread printed.
"""
import argparse

import torch
import torch.distributed as dist

from torchpp.context_parallel.chunk_states import active
from torchpp.context_parallel.delta_rule import wrap_modeling
from torchpp.context_parallel.selective_scan import wrap_modeling as wrap_mamba1_modeling
from torchpp.context_parallel.hf import ContextParallel

from timing import interleaved, median_spread  # bench/timing.py, next to this script


def inputs(seq: int, args, generator):
    shapes = ([1, seq, args.k_heads, args.d_k], [1, seq, args.k_heads, args.d_k], [1, seq, args.v_heads, args.d_v],
              [1, seq, args.v_heads], [1, seq, args.v_heads])
    query, key, value, decay, beta = (torch.randn(s, generator=generator) for s in shapes)
    tensors = [query, key, value, -decay.abs() * 0.1, beta.sigmoid()]
    return [t.requires_grad_() for t in tensors], torch.randn(1, seq, args.v_heads, args.d_v, generator=generator)


def delta_rule_case(args, world: int, generator):
    """(run on this rank's shard, run on the whole sequence, description)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5

    wrap_modeling(modeling_qwen3_5)
    rule = modeling_qwen3_5.torch_chunk_gated_delta_rule
    local, local_grad = inputs(args.seq // world, args, generator)
    whole, whole_grad = inputs(args.seq, args, generator)
    what = (f"gated delta rule, forward + backward, seq {args.seq}, {args.k_heads} key heads of {args.d_k}, "
            f"{args.v_heads} value heads of {args.d_v}")
    return (lambda: rule(*local, use_qk_l2norm_in_kernel=True)[0].backward(local_grad),
            lambda: rule(*whole, use_qk_l2norm_in_kernel=True)[0].backward(whole_grad), what)


def selective_scan_case(args, world: int, generator):
    from transformers.models.mamba import modeling_mamba

    wrap_mamba1_modeling(modeling_mamba)
    scan = modeling_mamba.mamba_selective_scan
    channels, d_state = args.channels, args.d_state
    a = (-torch.rand(channels, d_state, generator=generator) - 0.1).requires_grad_()
    d, bias = (torch.randn(channels, generator=generator).requires_grad_() for _ in range(2))

    def operands(seq):
        x, dt, z = (torch.randn(1, channels, seq, generator=generator).requires_grad_() for _ in range(3))
        b, c = (torch.randn(1, d_state, seq, generator=generator).requires_grad_() for _ in range(2))
        return (x, dt, b, c, z), torch.randn(1, channels, seq, generator=generator)

    def run(tensors, grad):
        x, dt, b, c, z = tensors
        scan(x, dt, a, b, c, D=d, z=z, delta_bias=bias, delta_softplus=True).backward(grad)

    local, whole = operands(args.seq // world), operands(args.seq)
    what = f"Mamba-1 selective scan, forward + backward, seq {args.seq}, {channels} channels, state {d_state}"
    return lambda: run(*local), lambda: run(*whole), what


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--scan", choices=("delta-rule", "selective"), default="delta-rule")
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--k-heads", type=int, default=4)
    parser.add_argument("--v-heads", type=int, default=8)
    parser.add_argument("--d-k", type=int, default=64)
    parser.add_argument("--d-v", type=int, default=64)
    parser.add_argument("--channels", type=int, default=256, help="selective scan: d_inner")
    parser.add_argument("--d-state", type=int, default=16, help="selective scan: state size per channel")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    cp = ContextParallel(dist.group.WORLD)
    world, rank = cp.size, dist.get_rank()
    case = selective_scan_case if args.scan == "selective" else delta_rule_case
    sharded, whole, what = case(args, world, torch.Generator().manual_seed(rank))

    def run(name):
        if name == "whole":
            return whole()
        token = active.set(cp)
        try:
            sharded()
        finally:
            active.reset(token)

    variants = ("sharded", "whole")
    samples = interleaved(run, variants, args.repeats, warmup=1)
    if rank == 0:
        print(f"{what}, fp32, one thread per rank, {args.repeats} repeats")
        for name in variants:
            median, spread = median_spread(samples[name])
            where = "1 process, whole sequence" if name == "whole" else f"cp={world}"
            print(f"  {name:8s} {median * 1e3:9.1f} ms  spread {spread:.2f}  ({where})")
        med = {name: median_spread(samples[name])[0] for name in variants}
        print(f"  sharded / whole: {med['sharded'] / med['whole']:.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
