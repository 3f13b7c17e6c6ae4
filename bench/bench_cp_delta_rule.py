"""The gated delta rule (Qwen3.5's linear attention) over a sequence split across cp ranks.

    torchrun --standalone --nproc-per-node 2 bench/bench_cp_delta_rule.py

One forward + backward of transformers' own chunked delta rule (Qwen3.5's
torch_chunk_gated_delta_rule, float32), sharded by torchpp.context_parallel.delta_rule at cp =
world size (each rank runs its chunks on values widened by d_k columns, then composes the states
entering them from every chunk's all-gathered map), against the same rule on the whole sequence
in one process (the peer: what each rank would run without cp). One thread per rank; repeats
interleaved; median and spread printed.
"""
import argparse

import torch
import torch.distributed as dist

from torchpp.context_parallel.chunk_states import active
from torchpp.context_parallel.delta_rule import wrap_modeling
from torchpp.context_parallel.hf import ContextParallel

from timing import interleaved, median_spread  # bench/timing.py, next to this script


def inputs(seq: int, args, generator):
    shapes = ([1, seq, args.k_heads, args.d_k], [1, seq, args.k_heads, args.d_k], [1, seq, args.v_heads, args.d_v],
              [1, seq, args.v_heads], [1, seq, args.v_heads])
    query, key, value, decay, beta = (torch.randn(s, generator=generator) for s in shapes)
    tensors = [query, key, value, -decay.abs() * 0.1, beta.sigmoid()]
    return [t.requires_grad_() for t in tensors], torch.randn(1, seq, args.v_heads, args.d_v, generator=generator)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--k-heads", type=int, default=4)
    parser.add_argument("--v-heads", type=int, default=8)
    parser.add_argument("--d-k", type=int, default=64)
    parser.add_argument("--d-v", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    from transformers.models.qwen3_5 import modeling_qwen3_5

    wrap_modeling(modeling_qwen3_5)
    rule = modeling_qwen3_5.torch_chunk_gated_delta_rule
    cp = ContextParallel(dist.group.WORLD)
    world, rank = cp.size, dist.get_rank()
    g = torch.Generator().manual_seed(rank)
    local, local_grad = inputs(args.seq // world, args, g)
    whole, whole_grad = inputs(args.seq, args, g)

    def run(name):
        if name == "whole":
            rule(*whole, use_qk_l2norm_in_kernel=True)[0].backward(whole_grad)
            return
        token = active.set(cp)
        try:
            out, _ = rule(*local, use_qk_l2norm_in_kernel=True)
        finally:
            active.reset(token)
        out.backward(local_grad)

    variants = ("sharded", "whole")
    samples = interleaved(run, variants, args.repeats, warmup=1)
    if rank == 0:
        print(f"gated delta rule, forward + backward, seq {args.seq}, {args.k_heads} key heads of {args.d_k}, "
              f"{args.v_heads} value heads of {args.d_v}, fp32, one thread per rank, {args.repeats} repeats")
        for name in variants:
            median, spread = median_spread(samples[name])
            where = "1 process, whole sequence" if name == "whole" else f"cp={world}"
            print(f"  {name:8s} {median * 1e3:9.1f} ms  spread {spread:.2f}  ({where})")
        med = {name: median_spread(samples[name])[0] for name in variants}
        print(f"  sharded / whole: {med['sharded'] / med['whole']:.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
