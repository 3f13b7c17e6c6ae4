"""DualPipe's forward-backward overlap under expert parallelism: how much of the experts'
all-to-all is hidden behind the other direction's compute, from the real run's profiler trace,
and the step time with the overlap against the same schedule run one action at a time.

A Mixtral-shaped model at ep=2 x pp=2 (4 ranks, dp=2) under dualpipe. The executor runs each
overlapped pair (a forward and another microbatch's backward) in two threads; the profiler
records every all-to-all (torchpp::moe::all_to_all, dispatch, combine and the routing counts,
forward and backward) and every compute action (torchpp::pipeline::F/B/I/W) with its thread.
An all-to-all is hidden where the other thread is computing meanwhile: inside one of its
compute actions and not itself waiting in an all-to-all. Step times: both variants interleaved
per repeat; medians and spreads ((max-min)/median).

    PYTHONPATH=. torchrun --standalone --nproc-per-node 4 bench/bench_ep_overlap.py --repeats 10
"""
import argparse
import copy
import warnings
from typing import Dict, List, Tuple

import torch
import torch.distributed as dist

import torchpp
from timing import interleaved, median_spread

A2A = "torchpp::moe::all_to_all"
COMPUTE = ("torchpp::pipeline::F", "torchpp::pipeline::B", "torchpp::pipeline::I", "torchpp::pipeline::W")


def make_model(args):
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(vocab_size=512, hidden_size=args.hidden, intermediate_size=args.ffn,
                           num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                           num_local_experts=args.experts, num_experts_per_tok=2)
    torch.manual_seed(0)
    return MixtralForCausalLM(config)


Span = Tuple[float, float]


def _union(spans: List[Span]) -> List[Span]:
    merged: List[Span] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _subtract(spans: List[Span], holes: List[Span]) -> List[Span]:
    out = []
    for start, end in spans:
        cursor = start
        for h_start, h_end in holes:
            if h_end <= cursor or h_start >= end:
                continue
            if h_start > cursor:
                out.append((cursor, h_start))
            cursor = max(cursor, h_end)
        if cursor < end:
            out.append((cursor, end))
    return out


def _overlap(span: Span, spans: List[Span]) -> float:
    return sum(max(0.0, min(span[1], e) - max(span[0], s)) for s, e in spans)


def hidden_share(events) -> Tuple[float, float, float, int]:
    """(all-to-all seconds, of which inside an overlapped pair (the other thread runs an action
    meanwhile), of which hidden, all-to-all count) from profiler events."""
    by_thread: Dict[int, Dict[str, List[Span]]] = {}
    for event in events:
        kind = "a2a" if event.name == A2A else "compute" if event.name in COMPUTE else None
        if kind is None:
            continue
        span = (event.time_range.start / 1e6, event.time_range.end / 1e6)
        by_thread.setdefault(event.thread, {"a2a": [], "compute": []})[kind].append(span)
    busy = {tid: _subtract(_union(spans["compute"]), _union(spans["a2a"])) for tid, spans in by_thread.items()}
    total = paired = hidden = 0.0
    count = 0
    for tid, spans in by_thread.items():
        others_busy = _union([s for other, b in busy.items() if other != tid for s in b])
        others_running = _union([s for other, t in by_thread.items() if other != tid for s in t["compute"]])
        for span in spans["a2a"]:
            total += span[1] - span[0]
            paired += _overlap(span, others_running)
            hidden += _overlap(span, others_busy)
            count += 1
    return total, paired, hidden, count


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--ffn", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--n-microbatches", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    from torchpp.models import parallelize

    state = torchpp.init_parallel(pp=2, ep=2)
    base = make_model(args)
    models = {overlap: parallelize(copy.deepcopy(base), state=state, ep=2, schedule="dualpipe",
                                   n_microbatches=args.n_microbatches, overlap_forward_backward=overlap)
              for overlap in (True, False)}
    ids = torch.randint(0, 512, (args.n_microbatches, args.seq), generator=torch.Generator().manual_seed(1 + state.dp_rank))

    def step(overlap):
        model = models[overlap]
        model.step(ids if model.has_first_stage else None, ids if model.has_last_stage else None)
        for p in model.parameters():
            p.grad = None

    from torch.profiler import ProfilerActivity, profile

    shares = {}
    for overlap in (True, False):
        step(overlap)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step(overlap)
        shares[overlap] = hidden_share(prof.events())
    times = interleaved(step, (True, False), args.repeats)
    table = torch.tensor([[*shares[o], *median_spread(times[o])] for o in (True, False)], dtype=torch.float64)
    gathered = [torch.empty_like(table) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, table)
    if rank == 0:
        print(f"Mixtral h={args.hidden} ffn={args.ffn} layers={args.layers} experts={args.experts} top-2, "
              f"seq {args.seq}, ep=2 x pp=2 (dp=2) dualpipe, {args.n_microbatches} microbatches of 1 row per rank")
        for r, t in enumerate(gathered):
            on, off = t[0].tolist(), t[1].tolist()
            print(f"rank {r}: all-to-all {on[0] * 1e3:.0f} ms in {int(on[3])} calls, hidden behind the other "
                  f"direction's compute {on[2] / on[0]:.0%} ({on[2] / max(on[1], 1e-12):.0%} of the "
                  f"{on[1] / on[0]:.0%} inside overlapped pairs); one action at a time: "
                  f"{off[2] / max(off[0], 1e-12):.0%} of {off[0] * 1e3:.0f} ms")
        on, off = gathered[0][0].tolist(), gathered[0][1].tolist()
        print(f"step time: overlap {on[4] * 1e3:.1f} ms (spread {on[5]:.0%}), one action at a time "
              f"{off[4] * 1e3:.1f} ms (spread {off[5]:.0%}): sequential / overlap = {off[4] / on[4]:.2f}x")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
