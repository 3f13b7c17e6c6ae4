"""torch.ops.torchpp's moe_route / moe_dispatch / moe_combine at ep=2 and ep=4 (gloo, float64):
outputs and the gradients of the tokens, the routing weights and the experts equal a
single-process reference that runs every rank's tokens through all the experts; uneven routing
(every token to one rank's experts, so other ranks send and receive nothing) and a capacity that
drops pairs, whose count is reported."""
import math

import pytest
import torch
import torch.distributed as dist

from torchpp import ops

TOKENS, HIDDEN, TOP_K = 6, 5, 2


def rank_inputs(rank: int, num_experts: int, routing: str):
    """Rank `rank`'s tokens [T, h], expert indices [T, k], weights [T, k] and output probe."""
    g = torch.Generator().manual_seed(100 + rank)
    hidden = torch.randn(TOKENS + rank, HIDDEN, generator=g, dtype=torch.float64)  # uneven token counts
    if routing == "random":
        index = torch.stack([torch.randperm(num_experts, generator=g)[:TOP_K] for _ in range(hidden.size(0))])
    else:  # every pair to experts 0 and 1, both on rank 0
        index = torch.tensor([[0, 1]] * hidden.size(0))
    weights = torch.rand(hidden.size(0), TOP_K, generator=g, dtype=torch.float64)
    probe = torch.randn(hidden.size(0), HIDDEN, generator=g, dtype=torch.float64)
    return hidden, index, weights, probe


def expert_weights(num_experts: int) -> torch.Tensor:
    return torch.randn(num_experts, HIDDEN, HIDDEN, generator=torch.Generator().manual_seed(5), dtype=torch.float64)


def expert(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.tanh(rows @ weight)


def kept_pairs(index: torch.Tensor, num_experts: int, capacity_factor):
    """[T, k] mask of the pairs a capacity keeps: an expert's first `capacity` pairs in token order."""
    keep = torch.ones_like(index, dtype=torch.bool)
    if capacity_factor is None:
        return keep
    capacity = math.ceil(capacity_factor * index.numel() / num_experts)
    seen = [0] * num_experts
    for t in range(index.size(0)):
        for j in range(index.size(1)):
            e = int(index[t, j])
            keep[t, j] = seen[e] < capacity
            seen[e] += 1
    return keep


def reference(world: int, num_experts: int, routing: str, capacity_factor):
    """Every rank's outputs and gradients, computed in one process with all experts."""
    weight = expert_weights(num_experts).requires_grad_()
    results = []
    total = 0
    for rank in range(world):
        hidden, index, weights, probe = rank_inputs(rank, num_experts, routing)
        hidden.requires_grad_(), weights.requires_grad_()
        keep = kept_pairs(index, num_experts, capacity_factor)
        out = torch.zeros_like(hidden)
        for t in range(hidden.size(0)):
            for j in range(TOP_K):
                if keep[t, j]:
                    out[t] = out[t] + weights[t, j] * expert(hidden[t:t + 1], weight[index[t, j]])[0]
        total = total + (out * probe).sum()
        results.append((out, hidden, weights, int((~keep).sum())))
    total.backward()
    return [(out.detach(), h.grad, w.grad, dropped) for out, h, w, dropped in results], weight.grad


def check_dispatch_combine(num_experts: int, routing: str, capacity_factor=None, device="cpu"):
    """On `device` (tests/gpu: CUDA over NCCL) against the float64 reference computed on the CPU."""
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(world)))
    local = num_experts // world
    hidden, index, weights, probe = (t.to(device) for t in rank_inputs(rank, num_experts, routing))
    hidden.requires_grad_(), weights.requires_grad_()
    weight = expert_weights(num_experts)[rank * local:(rank + 1) * local].to(device).requires_grad_()

    routing_plan = ops.moe_route(index, num_experts, group, capacity_factor=capacity_factor)
    rows = ops.moe_dispatch(hidden, routing_plan)
    counts = routing_plan.tokens_per_local_expert.tolist()
    assert rows.shape == (sum(counts), HIDDEN)
    outputs = [expert(block, weight[e]) for e, block in enumerate(rows.split(counts))]
    out = ops.moe_combine(torch.cat(outputs), weights, routing_plan)
    (out * probe).sum().backward()

    expected, weight_grad = reference(world, num_experts, routing, capacity_factor)
    ref_out, ref_hidden_grad, ref_weights_grad, ref_dropped = expected[rank]
    assert out.device == hidden.device
    torch.testing.assert_close(out.cpu(), ref_out, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(hidden.grad.cpu(), ref_hidden_grad, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(weights.grad.cpu(), ref_weights_grad, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(weight.grad.cpu(), weight_grad[rank * local:(rank + 1) * local], rtol=1e-9,
                               atol=1e-12)
    assert int(routing_plan.dropped) == ref_dropped
    return int(routing_plan.dropped), sum(counts)


def check_compiled():
    """route -> dispatch -> experts -> combine inside torch.compile'd code equals eager, output and
    gradients: the ops break the graph (their sizes depend on the routing) and run eagerly."""
    rank = dist.get_rank()
    hidden, index, weights, probe = rank_inputs(rank, 4, "random")
    weight = expert_weights(4)[rank * 2:(rank + 1) * 2]

    def moe(hidden, weights):
        routing = ops.moe_route(index, 4)
        rows = ops.moe_dispatch(hidden, routing)
        counts = routing.tokens_per_local_expert.tolist()
        outputs = [expert(block, weight[e]) for e, block in enumerate(rows.split(counts))]
        return ops.moe_combine(torch.cat(outputs), weights, routing)

    results = []
    for run in (moe, torch.compile(moe, backend="aot_eager")):
        h, w = hidden.clone().requires_grad_(), weights.clone().requires_grad_()
        out = run(h, w)
        results.append((out.detach(), *torch.autograd.grad((out * probe).sum(), (h, w))))
    for eager, compiled in zip(*results):
        torch.testing.assert_close(compiled, eager, rtol=1e-12, atol=0)
    return True


def test_compiled_code_runs_the_ops_eagerly(ranks):
    assert ranks(2).run(check_compiled) == [True, True]

def test_capacity_drops_and_reports(ranks):
    results = ranks(2).run(check_dispatch_combine, 4, "one_rank", capacity_factor=1.0)
    # Rank r routes its T_r tokens' 2 T_r pairs to experts 0 and 1 (T_r each); a capacity of
    # ceil(2 T_r / 4) pairs per expert drops the rest of each.
    tokens = [TOKENS + r for r in range(2)]
    assert [dropped for dropped, _ in results] == [2 * (t - math.ceil(t / 2)) for t in tokens]


def check_route_errors():
    group = dist.new_group([0, 1])
    index = torch.zeros(3, 2, dtype=torch.long)
    with pytest.raises(RuntimeError, match=r"num_experts=3 must be a positive multiple of the group size 2"):
        ops.moe_route(index, 3, group)
    with pytest.raises(RuntimeError, match=r"expert indices must lie in \[0, num_experts=4\), got values from 0 to 7"):
        ops.moe_route(index + torch.tensor([[0, 7]]), 4, group)
    with pytest.raises(RuntimeError, match=r"capacity_factor must be positive, got -1"):
        ops.moe_route(index, 4, group, capacity_factor=-1.0)
    return True


def test_route_errors_name_values(ranks):
    assert ranks(2).run(check_route_errors) == [True, True]


# Grouped by world size: the harness keeps one pool of ranks alive at a time.
@pytest.mark.parametrize("world, routing", [(2, "random"), (2, "one_rank"), (4, "random"), (4, "one_rank")])
def test_dispatch_combine_equal_reference(ranks, world, routing):
    results = ranks(world).run(check_dispatch_combine, 2 * world, routing)
    assert all(dropped == 0 for dropped, _ in results)
    received = [rows for _, rows in results]
    if routing == "one_rank":  # rank 0 holds experts 0 and 1: it gets every pair, the others none
        assert received[0] == 2 * sum(TOKENS + r for r in range(world)) and not any(received[1:])
