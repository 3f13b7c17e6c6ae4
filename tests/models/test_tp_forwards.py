"""Linears whose class writes its own forward: a TP style takes one only where that forward is
nn.Linear's math written out (Falcon's FalconLinear), and names the module otherwise."""
import pytest
import torch
from torch import nn

from torchpp.tensor_parallel.styles import PlanError
from torchpp.tensor_parallel.tp_forwards import check_own_forward, computes_base_forward


class WrittenOut(nn.Linear):
    """nn.Linear's math by hand, as transformers' FalconLinear."""

    def forward(self, input):
        out = input @ self.weight.T
        return out if self.bias is None else out + self.bias


class Scaled(nn.Linear):
    def forward(self, input):
        return 2 * (input @ self.weight.T + self.bias)


class Activated(nn.Linear):
    def forward(self, input):
        return torch.relu(input @ self.weight.T + self.bias)


class WithAdapter(nn.Linear):
    """An extra parameter at zero (a LoRA-style adapter) agrees at first but not after training."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.adapter = nn.Parameter(torch.zeros(self.out_features, self.in_features))

    def forward(self, input):
        return input @ (self.weight + self.adapter).T + self.bias


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_written_out_linear_counts_as_linear(dtype):
    for bias in (True, False):
        module = WrittenOut(6, 4, bias=bias).to(dtype)
        assert computes_base_forward(module, nn.Linear)
        check_own_forward(module, None, "h.0.dense", "colwise")  # no error


@pytest.mark.parametrize("cls", [Scaled, Activated, WithAdapter])
def test_other_forwards_are_refused_by_name(cls):
    module = cls(6, 4).double()
    assert not computes_base_forward(module, nn.Linear)
    with pytest.raises(PlanError, match=rf"h\.0\.dense: its class {cls.__name__} computes its own forward"):
        check_own_forward(module, None, "h.0.dense", "colwise")


def test_meta_module_cannot_tell():
    with torch.device("meta"):
        module = WrittenOut(6, 4)
    assert not computes_base_forward(module, nn.Linear)
    with pytest.raises(PlanError, match="computes its own forward"):
        check_own_forward(module, None, "h.0.dense", "rowwise")


def test_a_column_split_without_its_f_needs_the_copy_upstream():
    from torchpp.tensor_parallel.plan import resolve_plan

    model = nn.Sequential(nn.Linear(4, 2), nn.Linear(2, 4))
    with pytest.raises(PlanError, match=r"1 has style 'colwise_after_copy' \(no f on its input\), but no module has "
                                        r"'replicated_copy_output'"):
        resolve_plan(model, {"1": "colwise_after_copy"}, strict=True)
    assert resolve_plan(model, {"0": "replicated_copy_output", "1": "colwise_after_copy"}, strict=True)
