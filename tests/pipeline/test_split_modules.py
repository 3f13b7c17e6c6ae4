"""split_linears: which layers it swaps onto the split B/W op and which it leaves, what stays
the same (parameters, names, isinstance, hooks), and that swapped layers defer their weight
gradients under a capture and give an ordinary backward's gradients."""
import copy
import pickle

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations

from torchpp.pipeline import SplitBWLinear, weight_grad_store
from torchpp.pipeline.split_modules import SplitBWMultiheadAttention, split_linears, unsplit_linears


class OwnForward(nn.Linear):
    """A subclass with its own forward (LoRA-style): not ours to change."""

    def forward(self, x):
        return super().forward(x) * 2


class KeepsForward(nn.Linear):
    """A subclass that keeps nn.Linear's forward: swapped, keeping its own class in the MRO."""

    marker = "kept"


def _model():
    torch.manual_seed(0)
    return nn.ModuleDict({
        "plain": nn.Linear(8, 8),
        "no_bias": nn.Linear(8, 8, bias=False),
        "keeps": KeepsForward(8, 8),
        "own": OwnForward(8, 8),
        "split": SplitBWLinear(8, 8),
        "lazy": nn.LazyLinear(8),
        "normed": parametrizations.weight_norm(nn.Linear(8, 8)),
        "encoder": nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True),
    }).double()


def test_swaps_plain_layers_only():
    model = _model()
    names = split_linears(model)
    assert sorted(names) == ["encoder.linear1", "encoder.linear2", "encoder.self_attn", "encoder.self_attn.out_proj",
                             "keeps", "no_bias", "plain"]
    for name in names:
        module = model.get_submodule(name)
        assert type(module).__name__.startswith("SplitBW"), name
    assert isinstance(model["plain"], nn.Linear) and isinstance(model["plain"], SplitBWLinear)
    assert isinstance(model["keeps"], KeepsForward) and model["keeps"].marker == "kept"
    out_proj = model["encoder"].self_attn.out_proj
    assert isinstance(out_proj, nn.modules.linear.NonDynamicallyQuantizableLinear)
    assert isinstance(model["encoder"].self_attn, SplitBWMultiheadAttention)
    for name in ("own", "split", "lazy", "normed"):  # own forward, already split, lazy, computed weight
        assert not hasattr(type(model[name]), "_torchpp_plain_class"), name  # not swapped
    assert type(model["split"]) is SplitBWLinear


def test_parameters_names_and_hooks_stay():
    model = _model()
    params = dict(model.named_parameters())
    keys = list(model.state_dict())
    seen = []
    model["plain"].register_forward_hook(lambda *_: seen.append(1))
    split_linears(model)
    assert list(model.state_dict()) == keys
    assert all(p is params[n] for n, p in model.named_parameters())
    model["plain"](torch.randn(2, 8, dtype=torch.float64))
    assert seen == [1]


def test_idempotent_and_undone():
    model = _model()
    first = split_linears(model)
    classes = {n: type(m) for n, m in model.named_modules()}
    assert split_linears(model) == first
    assert {n: type(m) for n, m in model.named_modules()} == classes
    assert unsplit_linears(model) == len(first)
    assert type(model["plain"]) is nn.Linear and type(model["encoder"].self_attn) is nn.MultiheadAttention
    assert type(model["encoder"].self_attn.out_proj) is nn.modules.linear.NonDynamicallyQuantizableLinear
    assert type(model["keeps"]) is KeepsForward and type(model["split"]) is SplitBWLinear
    assert unsplit_linears(model) == 0


def test_pickles_and_copies_as_split():
    model = _model()
    del model["lazy"], model["normed"]  # nn's own limits: uninitialised / parametrized modules
    split_linears(model)
    for clone in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
        assert {n: type(m) for n, m in clone.named_modules()} == {n: type(m) for n, m in model.named_modules()}
        for a, b in zip(clone.parameters(), model.parameters()):
            assert torch.equal(a, b)


def _encoder_stack(seed=0):
    torch.manual_seed(seed)
    layers = [nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True) for _ in range(2)]
    return nn.Sequential(nn.Linear(4, 8), *layers, nn.Linear(8, 3)).double()


def _grads(model, x, y):
    model.zero_grad(set_to_none=True)
    nn.functional.mse_loss(model(x), y).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _deferred_run(model, loss_of):
    """Parameters whose gradient waited for W under a capture, and every gradient after W."""
    model.zero_grad(set_to_none=True)
    with weight_grad_store.capture(stage=0, microbatch=0):
        loss_of(model).backward()
    deferred = {n for n, p in model.named_parameters() if p.grad is None}
    ran = weight_grad_store.run(0, 0)
    assert weight_grad_store.pending() == 0
    return deferred, ran, {n: p.grad.clone() for n, p in model.named_parameters()}


def test_encoder_stack_defers_every_projection():
    plain, split = _encoder_stack(), _encoder_stack()
    split_linears(split)
    x = torch.randn(3, 5, 4, dtype=torch.float64, requires_grad=True)
    y = torch.randn(3, 5, 3, dtype=torch.float64)
    expected = _grads(plain, x, y)
    deferred, ran, grads = _deferred_run(split, lambda m: nn.functional.mse_loss(m(x), y))
    norms = {n for n, _ in split.named_parameters() if ".norm" in n}
    assert norms and deferred == {n for n, _ in split.named_parameters()} - norms
    assert ran == 2 + 2 * 4  # the two linears around the stack, per layer in_proj, out_proj, linear1, linear2
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-12, atol=1e-14, msg=name)


# (constructor options, how forward is called, which parameters defer)
ATTENTION_CASES = {
    "self": (dict(), "self", {"in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias"}),
    # key and value differ from the query: the packed weight is sliced per projection (not a leaf)
    "cross": (dict(), "cross", {"out_proj.weight", "out_proj.bias"}),
    # separate q/k/v weights (leaves), bias-free: all deferred
    "kdim": (dict(kdim=6, vdim=6, bias=False), "kdim", {"q_proj_weight", "k_proj_weight", "v_proj_weight",
                                                        "out_proj.weight"}),
}


@pytest.mark.parametrize("case", sorted(ATTENTION_CASES))
def test_attention_defers_leaf_projections(case):
    options, call, want = ATTENTION_CASES[case]

    def make():
        torch.manual_seed(0)
        return nn.MultiheadAttention(8, 2, batch_first=True, **options).double()

    plain, split = make(), make()
    split_linears(split)
    q = torch.randn(3, 5, 8, dtype=torch.float64)
    kv = torch.randn(3, 4, 6 if call == "kdim" else 8, dtype=torch.float64)
    args = (q, q, q) if call == "self" else (q, kv, kv)

    def loss_of(m):
        return m(*args, need_weights=False)[0].square().sum()

    plain.zero_grad(set_to_none=True)
    loss_of(plain).backward()
    deferred, ran, grads = _deferred_run(split, loss_of)
    assert deferred == want and ran == (2 if call == "self" else 1 if call == "cross" else 4)
    for name, param in plain.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, rtol=1e-12, atol=1e-14, msg=name)


def test_eval_fast_path_untouched():
    plain, split = _encoder_stack().eval(), _encoder_stack().eval()
    split_linears(split)
    x = torch.randn(3, 5, 4, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(split(x), plain(x), rtol=1e-12, atol=1e-14)
