"""partial_sum_bias in one process (the style needs only the TP size; the gradient sum over TP
it marks runs on gloo ranks in tests/distributed/test_gpt_oss.py): the forward adds bias / tp,
the attribute holds the whole parameter again after every forward, one that raised included, and
the parameter receives 1/tp of the gradient before the sum over TP."""
import types

import pytest
import torch
from torch import nn

from torchpp.tensor_parallel.styles import STYLES


class _AddsBias(nn.Module):
    def __init__(self):
        super().__init__()
        self.bias = nn.Parameter(torch.tensor([2.0, 4.0], dtype=torch.float64))

    def forward(self, x, fail=False):
        if fail:
            raise RuntimeError("the forward raised")
        return x + self.bias


def _applied(tp=2):
    module, ctx = _AddsBias(), types.SimpleNamespace(size=tp, hooks=[])
    STYLES["partial_sum_bias"].apply_param(module, "bias", "bias", ctx)
    return module, ctx


def test_each_rank_adds_its_share_of_the_bias():
    module, ctx = _applied(tp=4)
    whole = module.bias
    out = module(torch.zeros(2, dtype=torch.float64))
    torch.testing.assert_close(out, torch.tensor([0.5, 1.0], dtype=torch.float64), rtol=0, atol=0)
    assert module.bias is whole and module._parameters["bias"] is whole
    out.sum().backward()
    torch.testing.assert_close(whole.grad, torch.full((2,), 0.25, dtype=torch.float64), rtol=0, atol=0)
    assert whole.tp_grad_sum == "tp" and len(ctx.hooks) == 2  # summed over TP by install_grad_hooks


def test_the_parameter_is_back_after_a_forward_that_raised():
    module, _ = _applied()
    with pytest.raises(RuntimeError, match="raised"):
        module(torch.zeros(2, dtype=torch.float64), fail=True)
    assert isinstance(module._parameters["bias"], nn.Parameter)
    assert [p for p in module.parameters()] == [module.bias]


def test_the_trial_simulates_the_share():
    bias = _AddsBias().bias
    torch.testing.assert_close(STYLES["partial_sum_bias"].local_value(bias, "bias", 1, 2), bias.detach() / 2)
