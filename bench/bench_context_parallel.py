"""Context parallelism on a transformers Llama wrapped by parallelize(model, cp=).

    torchrun --standalone --nproc-per-node 4 bench/bench_context_parallel.py --part memory
    torchrun --standalone --nproc-per-node 2 bench/bench_context_parallel.py --part time
    torchrun --standalone --nproc-per-node 4 bench/bench_context_parallel.py --part peak
    torchrun --standalone --nproc-per-node 2 bench/bench_context_parallel.py --part window
    torchrun --standalone --nproc-per-node 2 bench/bench_context_parallel.py --part sparse

memory  bytes autograd keeps for backward per rank (torchpp.plan.SavedActivationMeter: CPU has no
        allocator statistics) for sequence lengths 1k-4k at cp = 1, 2, 4 (cp=1: the unwrapped
        model on one rank), and their ratio to cp=1: it should fall as ~1/c.
time    one forward + backward at a long sequence, cp = world size: ring vs all-gather vs
        all-to-all attention (and at 4+ ranks all-to-all inside pairs of ranks with the ring across
        them), and the unwrapped model on one rank (the peer: plain transformers). Then the
        share of the ring's key/value transfers hidden behind the attention blocks, from a
        torch.profiler trace of the ring op's own spans (torchpp::ring_attention::wait is
        the exposed transfer) against the same exchange timed alone (no compute beside it).
        The trace is written to runs/bench_cp/ (Chrome trace JSON).
peak    the attention op alone (torchpp.context_parallel.attention), one forward + backward at
        cp = 2 and cp = world: the most bytes live at once beyond its inputs, per rank (the
        largest rank), ring vs all-gather vs all-to-all (vs all-to-all+ring at cp = world), against
        SDPA on the whole sequence in one process
        (the peer), in MB and in units of one rank's key/value shard; from torch.profiler's
        memory timeline (CPU allocations: every tensor the ops make, transfer buffers included).
sparse  DeepSeek-V3.2 (sparse indexed attention: an indexer keeps each query's top k keys) and
        DeepSeek-V4 (a sliding window plus compressed entries, heavily compressed and sparse) at
        cp = world, wrapped by parallelize, against the unwrapped model on one rank (the peer:
        transformers' own path, SDPA or eager with the whole [s, s] mask): one forward +
        backward, and the bytes autograd keeps for backward per rank.
window  the attention op alone with a sliding window (--window) at cp = world, ring: time and peak
        bytes beyond the inputs, against causal attention without a window on the same shards
        and against SDPA with the sliding mask on the whole sequence in one process (the peer:
        transformers' SDPA path with a window).
Repeats are interleaved so machine noise hits every variant alike; median and spread are printed.
"""
import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

import torchpp
from torchpp import context_parallel
from torchpp.models import parallelize
from torchpp.parallel.object_collectives import all_gather_objects
from torchpp.plan import SavedActivationMeter

from timing import interleaved, median_spread  # bench/timing.py, next to this script


def make_model(args):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads,
                         max_position_embeddings=65536)
    return LlamaForCausalLM(config)


def batch(seq_len: int):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (1, seq_len), generator=g)
    return ids, ids.clone()


def saved_bytes(model, seq_len: int) -> int:
    ids, labels = batch(seq_len)
    params = list(model.parameters())
    with SavedActivationMeter(exclude=params) as meter:
        loss = model(input_ids=ids, labels=labels, use_cache=False).loss
    loss.backward()
    model.zero_grad(set_to_none=True)
    return meter.peak_bytes


def memory_part(args, world: int) -> None:
    rank = dist.get_rank()
    rows = {}
    for cp in (1, 2, 4):
        if world % cp:
            continue
        state = torchpp.init_parallel(cp=cp)
        model = make_model(args)
        if cp > 1:
            model = parallelize(model, state=state)
        rows[cp] = [saved_bytes(model, s) for s in args.seq_lens]
    if rank == 0:
        print(f"saved-for-backward bytes per rank, Llama h={args.hidden} layers={args.layers} (batch 1)")
        print(f"{'seq':>6} " + " ".join(f"{f'cp={cp} (MB)':>12} {'/cp=1':>6}" for cp in rows))
        for k, s in enumerate(args.seq_lens):
            cells = [f"{rows[cp][k] / 1e6:12.2f} {rows[cp][k] / rows[1][k]:6.3f}" for cp in rows]
            print(f"{s:>6} " + " ".join(cells))


def time_part(args, world: int) -> None:
    rank = dist.get_rank()
    state = torchpp.init_parallel(cp=world)
    ids, labels = batch(args.long_seq)
    variants = {"ring": parallelize(make_model(args), state=state, cp_mode="ring"),
                "all-gather": parallelize(make_model(args), state=state, cp_mode="all-gather"),
                "all-to-all": parallelize(make_model(args), state=state, cp_mode="all-to-all")}
    if world > 2 and world % 2 == 0:  # all-to-all inside pairs of ranks, the ring across the pairs
        variants["a2a+ring"] = parallelize(make_model(args), state=state, cp_mode="all-to-all+ring",
                                           cp_all_to_all_size=2)
    variants["unwrapped"] = make_model(args)

    def step(name):
        model = variants[name]
        if name == "unwrapped" and rank != 0:
            return  # the peer runs on one rank; the others wait at the barrier
        model(input_ids=ids, labels=labels, use_cache=False).loss.backward()
        model.zero_grad(set_to_none=True)

    samples = interleaved(step, variants, args.repeats, warmup=1)
    med = {name: median_spread(v)[0] for name, v in samples.items()}
    spread = {name: median_spread(v)[1] for name, v in samples.items()}
    if rank == 0:
        print(f"forward + backward, seq {args.long_seq}, cp={world}, {args.repeats} repeats (median, spread)")
        for name in variants:
            where = "1 rank, full sequence" if name == "unwrapped" else f"cp={world}"
            print(f"  {name:10s} {med[name] * 1e3:9.1f} ms  spread {spread[name]:.2f}  ({where})")
        print(f"  ring / all-gather: {med['ring'] / med['all-gather']:.3f}   "
              f"all-to-all / ring: {med['all-to-all'] / med['ring']:.3f}   "
              f"ring / unwrapped: {med['ring'] / med['unwrapped']:.3f}   "
              f"all-to-all / unwrapped: {med['all-to-all'] / med['unwrapped']:.3f}")
        if "a2a+ring" in med:
            print(f"  a2a+ring / ring: {med['a2a+ring'] / med['ring']:.3f}   "
                  f"a2a+ring / all-to-all: {med['a2a+ring'] / med['all-to-all']:.3f}")
    hidden_share(args, variants["ring"], ids, labels, world)


def peak_beyond_inputs(run) -> int:
    """The most CPU bytes live at once during run() beyond those live when it starts: from the
    memory profiler's timeline, or where its data-flow check rejects the trace (an address freed
    by gloo's thread and reused within one op reads as a duplicate output) from the allocation
    events themselves, summed in time order (no second run: the others ranks' collectives would
    not wait for it)."""
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import MemoryProfileTimeline  # private: the timeline behind profile's memory plot

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        run()
    try:
        _, sizes = MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline(torch.device("cpu"))
    except AssertionError:
        changes = sorted((e.time_range.start, e.cpu_memory_usage) for e in prof.events() if e.name == "[memory]")
        live = peak = 0
        for _, change in changes:
            live += change
            peak = max(peak, live)
        return peak
    live = [sum(categories) for categories in sizes]
    return max(live) - live[0]


def attention_peak(args, mode: str, group, cp: int) -> int:
    """Peak bytes beyond the inputs of one forward + backward of the CP attention on `group`,
    global ranks 0..cp-1 (the others return 0); mode "sdpa": the unwrapped attention, cp=1;
    "all-to-all+ring": `group` is its pair of groups."""
    if dist.get_rank() >= cp:
        return 0
    g = torch.Generator().manual_seed(dist.get_rank())
    head_dim = args.hidden // args.heads
    shape = (1, args.heads, args.long_seq // cp, head_dim)
    q, k, v = (torch.randn(shape, generator=g, requires_grad=True) for _ in range(3))
    grad = torch.randn(shape, generator=g)

    def run():
        if mode == "sdpa":
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            out = context_parallel.attention(q, k, v, group, mode=mode)
        out.backward(grad)

    run()  # warm-up: lazily made state (the ring's channels) is not counted
    q.grad = k.grad = v.grad = None
    return peak_beyond_inputs(run)


def peak_part(args, world: int) -> None:
    rank = dist.get_rank()
    head_dim = args.hidden // args.heads
    rows = {1: {"sdpa": attention_peak(args, "sdpa", None, 1)}}
    dist.barrier()
    for cp in sorted({2, world}):
        group = dist.new_group(list(range(cp)))
        rows[cp] = {mode: attention_peak(args, mode, group, cp) for mode in ("ring", "all-gather", "all-to-all")}
        if cp == world and cp > 2 and cp % 2 == 0:  # (its groups are made by every rank: cp = world alone)
            pair = context_parallel.hierarchical_groups(2, group)
            rows[cp]["all-to-all+ring"] = attention_peak(args, "all-to-all+ring", pair, cp)
    everyone = all_gather_objects(rows)
    if rank != 0:
        return
    print(f"attention alone, forward + backward, seq {args.long_seq}, {args.heads} heads of {head_dim}, fp32, batch 1: "
          "peak bytes beyond the inputs (largest rank)")
    print(f"{'cp':>3} {'variant':>15} {'MB':>9} {'/ K+V shard':>12}")
    for cp, modes in rows.items():
        kv_shard = 2 * args.heads * (args.long_seq // cp) * head_dim * 4  # one rank's K and V, fp32
        for mode in modes:
            peak = max(r[cp][mode] for r in everyone)
            print(f"{cp:>3} {mode:>15} {peak / 1e6:9.2f} {peak / kv_shard:12.2f}")


def window_part(args, world: int) -> None:
    rank, group = dist.get_rank(), dist.group.WORLD
    head_dim, seq, w = args.hidden // args.heads, args.long_seq, args.window
    g = torch.Generator().manual_seed(rank)
    local = [torch.randn(1, args.heads, seq // world, head_dim, generator=g, requires_grad=True) for _ in range(3)]
    whole = [torch.randn(1, args.heads, seq, head_dim, generator=g, requires_grad=True) for _ in range(3)]
    grads = {"local": torch.randn(local[0].shape, generator=g), "whole": torch.randn(whole[0].shape, generator=g)}
    position = torch.arange(seq)
    sliding = (position[None, :] <= position[:, None]) & (position[:, None] - position[None, :] < w)

    def run(name):
        if name == "sdpa window":
            torch.nn.functional.scaled_dot_product_attention(*whole, attn_mask=sliding).backward(grads["whole"])
        else:
            context_parallel.attention(*local, group, window=w if name == "ring window" else None).backward(
                grads["local"])

    variants = ("ring window", "ring causal", "sdpa window")
    samples = interleaved(run, variants, args.repeats, warmup=1)
    peaks = {}
    for name in variants:
        run(name)  # warm-up: lazily made state is not counted
        dist.barrier()
        peaks[name] = max(all_gather_objects(peak_beyond_inputs(lambda: run(name))))
    if rank == 0:
        print(f"attention alone, forward + backward, seq {seq}, window {w}, {args.heads} heads of {head_dim}, fp32, "
              f"cp={world} ring, {args.repeats} repeats (median, spread); peak MB beyond the inputs (largest rank)")
        for name in variants:
            median, spread = median_spread(samples[name])
            where = "1 process, whole sequence" if name.startswith("sdpa") else f"cp={world}"
            print(f"  {name:12s} {median * 1e3:9.1f} ms  spread {spread:.2f}  peak {peaks[name] / 1e6:8.2f} MB  ({where})")
        med = {name: median_spread(samples[name])[0] for name in variants}
        print(f"  ring window / ring causal: {med['ring window'] / med['ring causal']:.3f}   "
              f"ring window / sdpa window: {med['ring window'] / med['sdpa window']:.3f}")


# Small models of the two families, long enough rows for the indexer to choose (its top k below the
# keys a query sees) and for the compressors to fill their windows (DeepSeek-V3.2's MLPs dense).
SPARSE_MODELS = {
    "deepseek_v32": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                         q_lora_rank=64, kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
                         index_n_heads=4, index_head_dim=32, index_topk=256, layer_types=["indexed_attention"] * 2,
                         mlp_layer_types=["dense"] * 2),
    "deepseek_v4": dict(hidden_size=256, intermediate_size=128, moe_intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, head_dim=64, q_lora_rank=64, index_n_heads=4, index_head_dim=32,
                        index_topk=256, sliding_window=128,
                        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
                        layer_types=["heavily_compressed_attention", "compressed_sparse_attention"],
                        mlp_layer_types=["hash_moe", "moe"]),
}


def sparse_part(args, world: int) -> None:
    from torchpp.testing.tiny_models import tiny_model

    rank = dist.get_rank()
    state = torchpp.init_parallel(cp=world)
    ids, labels = batch(args.long_seq)
    for model_type, overrides in SPARSE_MODELS.items():
        def build():
            return tiny_model(model_type, dtype=torch.float32, vocab_size=256, **overrides)
        variants = {"cp": parallelize(build(), state=state), "unwrapped": build()}

        def step(name):
            if name == "unwrapped" and rank != 0:
                return  # the peer runs on one rank; the others wait at the barrier
            model = variants[name]
            model(input_ids=ids, labels=labels, use_cache=False).loss.backward()
            model.zero_grad(set_to_none=True)

        samples = interleaved(step, variants, args.repeats, warmup=1)
        kept = {"cp": saved_bytes(variants["cp"], args.long_seq)}
        if rank == 0:
            kept["unwrapped"] = saved_bytes(variants["unwrapped"], args.long_seq)
            med = {name: median_spread(v) for name, v in samples.items()}
            print(f"{model_type}: forward + backward, seq {args.long_seq}, cp={world}, {args.repeats} repeats "
                  f"(median, spread); bytes kept for backward per rank")
            for name in variants:
                where = "1 rank, full sequence" if name == "unwrapped" else f"cp={world}"
                print(f"  {name:10s} {med[name][0] * 1e3:9.1f} ms  spread {med[name][1]:.2f}  "
                      f"{kept[name] / 1e6:9.2f} MB  ({where})")
            print(f"  cp / unwrapped: time {med['cp'][0] / med['unwrapped'][0]:.3f}, "
                  f"kept bytes {kept['cp'] / kept['unwrapped']:.3f}")


def exchange_seconds(kv: torch.Tensor, repeats: int) -> float:
    """The ring's step alone: send a key/value shard to the next rank, receive the previous one's."""
    rank, world = dist.get_rank(), dist.get_world_size()
    buffer = torch.empty_like(kv)
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, kv, (rank + 1) % world),
                                        dist.P2POp(dist.irecv, buffer, (rank - 1) % world)])
        for work in works:
            work.wait()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def hidden_share(args, model, ids, labels, world: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        model(input_ids=ids, labels=labels, use_cache=False).loss.backward()
    model.zero_grad(set_to_none=True)
    out_dir = os.path.join("runs", "bench_cp")
    os.makedirs(out_dir, exist_ok=True)
    prof.export_chrome_trace(os.path.join(out_dir, f"trace_rank{dist.get_rank()}.json"))
    waits, blocks = [], 0.0
    for event in prof.events():
        if event.name == "torchpp::ring_attention::wait":
            waits.append(event.cpu_time_total / 1e6)
        elif event.name.startswith("torchpp::ring_attention::block"):
            blocks += event.cpu_time_total / 1e6
    head_dim = args.hidden // args.heads
    shard = torch.randn(2, 1, args.heads, args.long_seq // world, head_dim)  # one ring message: a shard's K and V
    alone = exchange_seconds(shard, 20)
    # A wait longer than the transfer itself waited for the peer's compute (skew), not the link:
    # at most one transfer of each wait is exposed transfer time.
    exposed = sum(min(w, alone) for w in waits)
    share = 1.0 - exposed / (alone * len(waits)) if waits else float("nan")
    gathered = [None] * world
    dist.all_gather_object(gathered, (share, sum(waits), exposed, alone, len(waits), blocks))
    if dist.get_rank() == 0:
        print("ring transfers hidden behind compute (profiler spans of the ring op, one forward + backward):")
        for r, (s, waited, exp, one, n, blk) in enumerate(gathered):
            print(f"  rank {r}: {n} waits, {waited * 1e3:.1f} ms in all (skew included); one transfer alone "
                  f"{one * 1e3:.2f} ms -> exposed {exp * 1e3:.1f} ms of {n * one * 1e3:.1f} ms: hidden {s:.0%}; "
                  f"attention blocks {blk * 1e3:.1f} ms")
        print(f"  traces: {out_dir}/trace_rank*.json")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--part", choices=("memory", "time", "peak", "window", "sparse"), required=True)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--long-seq", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--window", type=int, default=256)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    world = dist.get_world_size()
    if args.part == "memory":
        memory_part(args, world)
    elif args.part == "peak":
        peak_part(args, world)
    elif args.part == "window":
        window_part(args, world)
    elif args.part == "sparse":
        sparse_part(args, world)
    else:
        time_part(args, world)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
