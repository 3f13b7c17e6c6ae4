"""Expert parallelism: parameters per rank vs ep, and the MoE layer's dispatch + combine time
(torchpp's C++ ops, and a plain-PyTorch peer over torch.distributed.nn's differentiable
all_to_all_single) against the experts' own compute, forward + backward.

Every rank holds --tokens tokens routed top-k over --experts experts split over all ranks
(ep = world size). Cases are interleaved per repeat; medians and spreads ((max-min)/median).

    PYTHONPATH=. torchrun --standalone --nproc-per-node 2 bench/bench_expert_parallel.py --repeats 20
"""
import argparse
import statistics
import time
import warnings

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import torch.nn.functional as F

import torchpp
import torchpp.ops as O


def params_per_rank(ep: int, args) -> tuple:
    """(expert parameters, other parameters) on this rank for a Mixtral-shaped model at ep."""
    from transformers import MixtralConfig, MixtralForCausalLM

    from torchpp.models import parallelize

    config = MixtralConfig(vocab_size=1000, hidden_size=args.hidden, intermediate_size=args.ffn,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           num_local_experts=args.experts, num_experts_per_tok=args.top_k)
    torch.manual_seed(0)
    model = MixtralForCausalLM(config)
    if ep > 1:
        model = parallelize(model, state=torchpp.init_parallel(ep=ep), ep=ep)
    experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    return experts, sum(p.numel() for p in model.parameters()) - experts


def routed(args, rank):
    g = torch.Generator().manual_seed(rank)
    hidden = torch.randn(args.tokens, args.hidden, generator=g)
    logits = torch.randn(args.tokens, args.experts, generator=g)
    weights, index = torch.topk(logits.softmax(-1), args.top_k, dim=-1)
    return hidden, index, weights


def run_experts(rows, counts, gate_up, down):
    outs = []
    for e, block in enumerate(rows.split(counts)):
        gate, up = F.linear(block, gate_up[e]).chunk(2, dim=-1)
        outs.append(F.linear(F.silu(gate) * up, down[e]))
    return torch.cat(outs)


def torchpp_layer(hidden, index, weights, num_experts, group, experts=None):
    routing = O.moe_route(index, num_experts, group)
    rows = O.moe_dispatch(hidden, routing)
    if experts is not None:
        rows = run_experts(rows, routing.tokens_per_local_expert.tolist(), *experts)
    return O.moe_combine(rows, weights, routing)


def plain_layer(hidden, index, weights, num_experts, group):
    """The same exchange written in Python over torch.distributed (what a codebase without
    torchpp writes): counts all-to-all, differentiable rows all-to-all there and back."""
    world, k = group.size(), index.size(1)
    flat = index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)
    send = counts.view(world, -1).sum(1).tolist()
    recv_counts = received.view(world, -1)
    recv = recv_counts.sum(1).tolist()
    rows = hidden.index_select(0, order // k)
    out = torch.empty(sum(recv), hidden.size(1))
    arrived = dist_nn.all_to_all_single(out, rows, recv, send, group=group)
    # Regrouped by local expert (source-major as they arrive), as the experts need them, and back.
    local = num_experts // world
    starts = (recv_counts.flatten().cumsum(0) - recv_counts.flatten()).view(world, local)
    perm = torch.cat([torch.arange(int(starts[s, e]), int(starts[s, e] + recv_counts[s, e]))
                      for e in range(local) for s in range(world)])
    expert_major = arrived.index_select(0, perm)  # (identity experts: the exchange alone is timed)
    source_major = torch.zeros_like(expert_major).index_copy(0, perm, expert_major)
    back = torch.empty(rows.shape)
    returned = dist_nn.all_to_all_single(back, source_major, send, recv, group=group)
    weighted = returned * weights.reshape(-1).index_select(0, order).unsqueeze(1)
    return torch.zeros_like(hidden).index_add(0, order // k, weighted)


def timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def summary(times):
    median = statistics.median(times)
    return median, (max(times) - min(times)) / median


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=512)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()

    sizes = {ep: params_per_rank(ep, args) for ep in sorted({1, world})}
    if rank == 0:
        print(f"Mixtral-shaped, 2 layers, hidden={args.hidden} ffn={args.ffn} experts={args.experts}: parameters per rank")
        print(f"{'ep':>3s} {'expert params':>14s} {'other params':>13s} {'expert ratio to ep=1':>21s}")
        for ep, (experts, other) in sizes.items():
            print(f"{ep:3d} {experts:14d} {other:13d} {experts / sizes[1][0]:21.3f}")

    group = dist.group.WORLD
    local = args.experts // world
    g = torch.Generator().manual_seed(7)
    gate_up = (torch.randn(local, 2 * args.ffn, args.hidden, generator=g) * 0.05).requires_grad_()
    down = (torch.randn(local, args.hidden, args.ffn, generator=g) * 0.05).requires_grad_()
    hidden, index, weights = routed(args, rank)
    counts = O.moe_route(index, args.experts, group).tokens_per_local_expert.tolist()
    rows = torch.randn(sum(counts), args.hidden).requires_grad_()

    def leaf():
        return hidden.clone().requires_grad_(), weights.clone().requires_grad_()

    def ours():
        h, w = leaf()
        torchpp_layer(h, index, w, args.experts, group).sum().backward()

    def plain():
        h, w = leaf()
        plain_layer(h, index, w, args.experts, group).sum().backward()

    def experts_only():
        run_experts(rows, counts, gate_up, down).sum().backward()

    def layer():
        h, w = leaf()
        torchpp_layer(h, index, w, args.experts, group, (gate_up, down)).sum().backward()

    def ours_unchecked():
        O.set_collective_checks(False)
        try:
            ours()
        finally:
            O.set_collective_checks(True)

    cases = {"dispatch+combine (torchpp)": ours, "  without the shape check": ours_unchecked,
             "dispatch+combine (plain)": plain,
             "experts' compute": experts_only, "MoE layer (torchpp)": layer}
    times = {name: [] for name in cases}
    for fn in cases.values():
        fn()  # warm-up
    for _ in range(args.repeats):
        for name, fn in cases.items():
            times[name].append(timed(fn))
    gathered = [None] * world
    dist.all_gather_object(gathered, times)
    if rank == 0:
        print(f"\nworld={world} ep={world} tokens/rank={args.tokens} top-k={args.top_k} hidden={args.hidden} "
              f"ffn={args.ffn} experts={args.experts} fp32 repeats={args.repeats} (forward + backward; slowest rank per "
              f"repeat; median, spread=(max-min)/median)")
        print(f"{'case':28s} {'ms':>8s} {'spread':>7s}")
        slowest = {name: [max(t[name][i] for t in gathered) for i in range(args.repeats)] for name in cases}
        for name in cases:
            median, spread = summary(slowest[name])
            print(f"{name:28s} {median:8.2f} {spread:7.2f}")
        ratio = summary(slowest["dispatch+combine (torchpp)"])[0] / summary(slowest["experts' compute"])[0]
        print(f"dispatch+combine / experts' compute: {ratio:.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
