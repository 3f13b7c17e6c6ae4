"""The split B/W linear: I then W gives exactly a standard linear backward's gradients, and
the weight gradient really waits for W."""
import pytest
import torch
import torch.nn.functional as F

from torchpp.pipeline import SplitBWLinear, split_bw_linear, weight_grad_store


def _leaves(dtype, batch_shape=(3, 5), seed=0, integer=False):
    g = torch.Generator().manual_seed(seed)
    make = (lambda *s: torch.randint(-4, 4, s, generator=g).to(dtype)) if integer else (
        lambda *s: torch.randn(*s, generator=g, dtype=dtype))
    x = make(*batch_shape, 8).requires_grad_()
    w = make(6, 8).requires_grad_()
    b = make(6).requires_grad_()
    grad = make(*batch_shape, 6)
    return x, w, b, grad


def _standard_grads(x, w, b, grad):
    F.linear(x, w, b).backward(grad)
    grads = [t.grad.clone() for t in (x, w, b)]
    for t in (x, w, b):
        t.grad = None
    return grads


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("batch_shape", [(7,), (3, 5)])
def test_i_then_w_equals_standard_backward(dtype, batch_shape):
    x, w, b, grad = _leaves(dtype, batch_shape)
    expected = _standard_grads(x, w, b, grad)
    with weight_grad_store.capture(stage=0, microbatch=0):
        split_bw_linear(x, w, b).backward(grad)
    assert w.grad is None and b.grad is None, "the weight gradient ran in I"
    torch.testing.assert_close(x.grad, expected[0], rtol=0, atol=0)
    assert weight_grad_store.run(0, 0) == 1
    torch.testing.assert_close(w.grad, expected[1], rtol=1e-12 if dtype is torch.float64 else 1e-6, atol=0)
    torch.testing.assert_close(b.grad, expected[2], rtol=1e-12 if dtype is torch.float64 else 1e-6, atol=0)


def test_exact_on_integer_values():
    x, w, b, grad = _leaves(torch.float32, integer=True)
    expected = _standard_grads(x, w, b, grad)
    with weight_grad_store.capture(0, 0):
        split_bw_linear(x, w, b).backward(grad)
    weight_grad_store.run(0, 0)
    for got, want in zip((x.grad, w.grad, b.grad), expected):
        assert torch.equal(got, want)


def test_without_capture_is_ordinary_linear():
    x, w, b, grad = _leaves(torch.float64)
    expected = _standard_grads(x, w, b, grad)
    split_bw_linear(x, w, b).backward(grad)
    assert weight_grad_store.pending() == 0
    for got, want in zip((x.grad, w.grad, b.grad), expected):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=0)


def test_deferred_w_runs_later_and_accumulates_in_order():
    """Two microbatches: both I passes first, then W of microbatch 1, then of microbatch 0; the
    gradient appears only when its W runs and ends equal to the summed standard backward."""
    layer = SplitBWLinear(8, 6).double()
    x0, x1 = torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64)
    reference = SplitBWLinear(8, 6).double()
    reference.load_state_dict(layer.state_dict())
    (reference(x0).sum() + reference(x1).sum()).backward()
    events = []
    for mb, x in enumerate((x0, x1)):
        with weight_grad_store.capture(stage=3, microbatch=mb):
            layer(x).sum().backward()
        events.append(("I", mb, layer.weight.grad is None))
    assert weight_grad_store.pending() == 2
    for mb in (1, 0):
        weight_grad_store.run(3, mb)
        events.append(("W", mb, layer.weight.grad is None))
    assert events == [("I", 0, True), ("I", 1, True), ("W", 1, False), ("W", 0, False)]
    torch.testing.assert_close(layer.weight.grad, reference.weight.grad, rtol=1e-12, atol=0)
    torch.testing.assert_close(layer.bias.grad, reference.bias.grad, rtol=1e-12, atol=0)
    assert weight_grad_store.run(3, 0) == 0  # already ran: nothing parked


def test_main_grad_receives_deferred_gradients():
    layer = SplitBWLinear(8, 6).to(torch.bfloat16)
    weight_grad_store.use_main_grad(layer)
    x = torch.randn(4, 8).to(torch.bfloat16)
    with weight_grad_store.capture(0, 0):
        layer(x).float().sum().backward()
    weight_grad_store.run(0, 0)
    assert layer.weight.grad is None
    assert layer.weight.main_grad.dtype == torch.float32
    expected = torch.ones(4, 6).t().mm(x.float())
    torch.testing.assert_close(layer.weight.main_grad, expected, rtol=1e-2, atol=1e-2)


def test_nested_capture_is_an_error():
    with weight_grad_store.capture(0, 0):
        with pytest.raises(RuntimeError, match="already capturing stage 0 microbatch 0"):
            with weight_grad_store.capture(0, 1):
                pass


def test_opcheck():
    x, w, b, _ = _leaves(torch.float64)
    torch.library.opcheck(torch.ops.torchpp.split_bw_linear.default, (x, w, b),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("deferred", [False, True], ids=["ordinary", "I_then_W"])
def test_autocast_computes_as_autocast_linear(deferred):
    """Under autocast the op computes in bf16 as F.linear does there (input, weight and bias
    cast), its input gradient leaves in bf16, and the weight/bias gradients reach the fp32
    parameters' .grad (deferred ones too): bit for bit what autocast's linear gives."""
    torch.manual_seed(0)
    first, reference_first = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
    layer, reference = SplitBWLinear(8, 6), torch.nn.Linear(8, 6)
    reference_first.load_state_dict(first.state_dict())
    reference.load_state_dict(layer.state_dict())
    x = torch.randn(5, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, want = layer(first(x)), reference(reference_first(x))
        direct = layer(x)  # an fp32 input is cast too
    assert out.dtype == direct.dtype == torch.bfloat16 and torch.equal(out, want)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(direct, reference(x))
    grad = torch.randn(5, 6).to(torch.bfloat16)
    if deferred:
        with weight_grad_store.capture(0, 0):
            out.backward(grad)
        assert layer.weight.grad is None and first.weight.grad is not None
        assert weight_grad_store.run(0, 0) == 1
    else:
        out.backward(grad)
    want.backward(grad)
    for got, expected in [(layer.weight, reference.weight), (layer.bias, reference.bias),
                          (first.weight, reference_first.weight), (first.bias, reference_first.bias)]:
        assert got.grad.dtype == torch.float32
        assert torch.equal(got.grad, expected.grad)


def test_autocast_leaves_float64_alone():
    x, w, b, grad = _leaves(torch.float64)
    expected = _standard_grads(x, w, b, grad)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = split_bw_linear(x, w, b)
    assert out.dtype == torch.float64
    out.backward(grad)
    for got, want in zip((x.grad, w.grad, b.grad), expected):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=0)


def test_compiled_module_still_defers_weight_gradients():
    """torch.compile breaks its graph around the op, whose C++ backward then parks the weight
    gradient as in eager mode (traced ahead of time, it would compute it at once)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(SplitBWLinear(8, 8), torch.nn.GELU(), SplitBWLinear(8, 4)).double()
    reference = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 4)).double()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(3, 8, dtype=torch.float64)
    with weight_grad_store.capture(0, 0):
        torch.compile(model, backend="aot_eager")(x).sum().backward()
    assert all(p.grad is None for p in model.parameters()), "the weight gradients ran in I"
    assert weight_grad_store.run(0, 0) == 2
    reference(x).sum().backward()
    for got, want in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-12, atol=0)
