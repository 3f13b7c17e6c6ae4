"""A module styled ``replicated_with_grad_allreduce`` whose children a plan splits (an attention
block holding its own parameters beside its split projections: DiffLlama's lambdas) sums the
gradients of its own replicated parameters over TP, never its children's shards: each rank's shard
gradient is its own. Before, the style marked every parameter below the module, so at tp=2 the
split projection's gradient came out summed over both ranks' different shards (a silent wrong
value, 2x off here) when the module came after its children in the plan, and the wrap failed
("sharded twice") when it came first. tp=2 on gloo, float64, against the unwrapped module."""
import copy

import pytest
import torch
from torch import nn

import torchpp
from torchpp.models import parallelize

TIMEOUT_S = 120
HEADS, HEAD_DIM, WIDTH = 2, 4, 8


class Attention(nn.Module):
    """A split projection, a vector of head_dim values every head multiplies by, a row-split output."""

    def __init__(self):
        super().__init__()
        self.q = nn.Linear(WIDTH, HEADS * HEAD_DIM, bias=False, dtype=torch.float64)
        self.scale = nn.Parameter(torch.randn(HEAD_DIM, dtype=torch.float64))
        self.o = nn.Linear(HEADS * HEAD_DIM, WIDTH, bias=False, dtype=torch.float64)

    def forward(self, x):
        h = self.q(x)
        h = (h.view(*h.shape[:-1], -1, HEAD_DIM) * self.scale).flatten(-2)  # -1: this rank's heads
        return self.o(torch.tanh(h))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = Attention()

    def forward(self, x):
        return self.attn(x)


PLANS = {"module first": {"attn": "replicated_with_grad_allreduce", "attn.q": "colwise", "attn.o": "rowwise"},
         "module last": {"attn.q": "colwise", "attn.o": "rowwise", "attn": "replicated_with_grad_allreduce"}}


def _gradients(plan):
    state = torchpp.init_parallel(tp=2)
    try:
        torch.manual_seed(0)
        model = Model()
        x = torch.randn(3, WIDTH, dtype=torch.float64)
        reference = copy.deepcopy(model)
        reference(x).square().sum().backward()
        wrapped = parallelize(model, plan={"tp": plan}, state=state)
        wrapped(x).square().sum().backward()
        rows = slice(state.tp_rank * HEAD_DIM, (state.tp_rank + 1) * HEAD_DIM)
        q, scale, o = wrapped.attn.q.weight, wrapped.attn.scale, wrapped.attn.o.weight
        torch.testing.assert_close(q.grad, reference.attn.q.weight.grad[rows], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(o.grad, reference.attn.o.weight.grad[:, rows], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(scale.grad, reference.attn.scale.grad, rtol=1e-10, atol=1e-12)  # summed over TP
        return tuple(q.shape)
    finally:
        torchpp.destroy_parallel()


@pytest.mark.parametrize("order", sorted(PLANS))
def test_replicated_module_sums_only_its_own_parameters(ranks, order):
    assert ranks(2).run(_gradients, PLANS[order], timeout=TIMEOUT_S) == [(HEAD_DIM, WIDTH)] * 2
