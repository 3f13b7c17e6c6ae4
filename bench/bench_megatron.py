"""torchpp's drop-in for Megatron-core's schedule function against Megatron's own, on the same
GPTModel (local layer spec, rope, fp32), p=2 gloo ranks on CPU, tp=1. Steps alternate between
the engines (paired), each timed between barriers on rank 0; median [p10, p90].

  * Megatron's forward_backward_pipelining_without_interleaving vs torchpp's 1f1b and zb-h1;
  * Megatron's forward_backward_pipelining_with_interleaving (two model chunks per rank) vs
    torchpp's interleaved-1f1b on the same chunks.

Megatron-core hard-codes a few CUDA calls: the CPU shim of the tests (tests/distributed/
megatron_cpu.py) patches them, as in the tests.

    PYTHONPATH=. python bench/bench_megatron.py [--repeats 12] [--m 8]
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "distributed"))
sys.path.insert(0, ROOT)

P = 2


def _quantiles(values):
    values = sorted(values)
    pick = lambda q: values[min(len(values) - 1, int(q * (len(values) - 1) + 0.5))]  # noqa: E731
    return statistics.median(values), pick(0.1), pick(0.9)


def _fmt(values, unit=""):
    med, lo, hi = _quantiles(values)
    return f"{med:.3f}{unit} [{lo:.3f}, {hi:.3f}]" if not unit else f"{med:.1f}{unit} [{lo:.1f}, {hi:.1f}]"


def _size_model(G) -> None:
    # A model where compute dominates the per-message overhead on CPU.
    G.VOCAB, G.HIDDEN, G.HEADS, G.FFN, G.LAYERS, G.SEQ, G.MBS = 512, 256, 4, 1024, 4, 64, 2


def _timed(func, chunks, batches, m, G) -> float:
    dist.barrier()
    start = time.perf_counter()
    G.run_schedule(func, chunks, batches, m)
    dist.barrier()
    return (time.perf_counter() - start) * 1e3


def _worker(rank: int, init: str, repeats: int, m: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=P,
                            timeout=datetime.timedelta(seconds=300))
    import megatron_gpt as G
    from megatron_cpu import megatron_on_cpu

    from torchpp.models.megatron import get_forward_backward_func

    _size_model(G)
    lines = []
    with megatron_on_cpu():
        from megatron.core.pipeline_parallel import get_forward_backward_func as megatron_func

        for vp, pairs in ((None, [("megatron 1F1B", None), ("torchpp 1f1b", "1f1b"), ("torchpp zb-h1", "zb-h1")]),
                          (2, [("megatron interleaved", None), ("torchpp interleaved-1f1b", "interleaved-1f1b")])):
            G.init_megatron(tp=1, pp=P, vp=vp)
            config = G.make_config(1, P, vp, params_dtype=torch.float32, pipeline_dtype=torch.float32)
            chunks = G.build_chunks(config)
            batches = G.make_batches(m)
            funcs = [(name, megatron_func() if schedule is None else get_forward_backward_func(schedule))
                     for name, schedule in pairs]
            times = {name: [] for name, _ in funcs}
            for _ in range(2):  # warm-up: compiles torchpp's schedule, fills allocator caches
                for name, func in funcs:
                    _timed(func, chunks, batches, m, G)
            for _ in range(repeats):
                for name, func in funcs:
                    for chunk in chunks:
                        chunk.zero_grad(set_to_none=True)
                    times[name].append(_timed(func, chunks, batches, m, G))
            base = pairs[0][0]
            lines.append(f"\n{'two chunks per rank' if vp else 'one chunk per rank'}, m={m}")
            lines.append("| engine | step (rank 0) | paired ratio vs " + base + " |")
            lines.append("|---|---|---|")
            for name, _ in funcs:
                ratios = [t / b for t, b in zip(times[name], times[base])]
                lines.append(f"| {name} | {_fmt(times[name], ' ms')} | {_fmt(ratios)} |")
    if rank == 0:
        with open(out, "w") as f:
            f.write("\n".join(lines) + "\n")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--m", type=int, default=8, help="microbatches per step")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.md")
        init = f"file://{os.path.join(tmp, 'rendezvous')}"
        mp.spawn(_worker, args=(init, args.repeats, args.m, out), nprocs=P, join=True)
        print(f"torch {torch.__version__}, p={P} gloo ranks, GPTModel hidden 256, ffn 1024, 4 layers, "
              f"seq 64, microbatch 2; median [p10, p90] over {args.repeats} paired steps")
        print(open(out).read())


if __name__ == "__main__":
    main()
