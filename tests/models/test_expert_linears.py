"""Experts' linears held in one 3-D weight (torchpp.tensor_parallel.expert_linears) are told from
other modules by what their forward computes, and ``local_widths`` divides only integer widths
the TP size divides, naming the offending value otherwise."""
import pytest
import torch
from torch import nn

from torchpp.tensor_parallel import expert_linears
from torchpp.tensor_parallel.local_widths import divide_widths, parse_local_widths_style
from torchpp.tensor_parallel.sharding import PlanError


class PerExpert(nn.Module):
    def __init__(self, experts=3, out=4, width=5):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(experts, out, width))

    def forward(self, inputs, sizes):
        return torch.cat([rows @ self.weight[i].t() for i, rows in enumerate(inputs.split(sizes))])


class EvenlyCut(PerExpert):  # cuts the rows evenly, whatever the sizes say
    def forward(self, inputs, sizes):
        return torch.cat([rows @ self.weight[i].t() for i, rows in enumerate(inputs.chunk(len(sizes)))])


class Scaled(PerExpert):  # not a plain linear per expert
    def forward(self, inputs, sizes):
        return 2 * super().forward(inputs, sizes)


@pytest.fixture(autouse=True)
def fresh_verdicts():
    expert_linears._VERDICTS.clear()
    yield
    expert_linears._VERDICTS.clear()


def test_expert_linears_are_told_by_their_forward():
    assert expert_linears.is_expert_linear(PerExpert())
    assert not expert_linears.is_expert_linear(EvenlyCut())
    assert not expert_linears.is_expert_linear(Scaled())
    assert not expert_linears.is_expert_linear(nn.Linear(4, 5))


def test_a_meta_module_is_checked_on_a_small_copy():
    with torch.device("meta"):
        module = PerExpert(experts=8, out=4096, width=1024)
    assert expert_linears.is_expert_linear(module)
    assert module.weight.is_meta  # the module itself untouched


def test_local_widths_divides_named_integer_widths():
    module = nn.Module()
    module.hidden_size, module.flag = 32, True
    assert parse_local_widths_style("local_widths(hidden_size)") == ("hidden_size",)
    assert parse_local_widths_style("colwise") is None
    divide_widths(module, ["hidden_size"], 2, "experts")
    assert module.hidden_size == 16
    with pytest.raises(PlanError, match="experts.hidden_size = 16, which tp=3 does not divide"):
        divide_widths(module, ["hidden_size"], 3, "experts")
    with pytest.raises(PlanError, match="experts.flag is True"):
        divide_widths(module, ["flag"], 2, "experts")
