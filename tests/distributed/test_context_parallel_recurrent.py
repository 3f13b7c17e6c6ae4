"""Linear recurrences over a sharded sequence (torchpp.context_parallel.chunk_states) on spawned
gloo ranks, against transformers' own functions on the whole sequence in float32 (they compute in
float32 whatever their inputs): the gated delta rule (``delta_rule``: Qwen3.5's, grouped value
heads and one decay per head; Kimi's delta attention, one decay per key channel), Mamba-2's chunked
scan (``mamba``: grouped B/C, the D skip term) and Mamba-1's selective scan (``selective_scan``:
one decay per channel and state entry, the skip term and the gate); each rank's output and the
gradients of its input shards, at cp=2 and cp=4, both layouts. The short convolutions with halos
likewise (a plain one, and Inkling 2's with per-token taps). Whole-model checks:
test_context_parallel_models.py."""
import copy

import pytest
import torch
import torch.distributed as dist

from torchpp.context_parallel.chunk_states import active
from torchpp.context_parallel.delta_rule import wrap_modeling
from torchpp.context_parallel.halo import apply_halos
from torchpp.context_parallel.mamba import wrap_modeling as wrap_mamba2_modeling
from torchpp.context_parallel.selective_scan import wrap_modeling as wrap_mamba1_modeling
from torchpp.context_parallel.hf import ContextParallel

BATCH, K_HEADS, V_HEADS, D_K, D_V = 2, 2, 4, 8, 6
# float32 rounding: the chunks' states are composed in another order than the whole sequence's scan.
RTOL, ATOL = 1e-5, 1e-6


def _modeling():
    from transformers.models.qwen3_5 import modeling_qwen3_5

    wrap_modeling(modeling_qwen3_5)  # calls through unless a sharded layer is running
    return modeling_qwen3_5


def _rule(family: str):
    if family == "qwen3_5":
        return _modeling().torch_chunk_gated_delta_rule
    from transformers.models.kimi_linear import modeling_kimi_linear

    wrap_modeling(modeling_kimi_linear, "chunk_kimi_delta_attention")
    return modeling_kimi_linear.chunk_kimi_delta_attention


def _inputs(seq_len: int, family: str = "qwen3_5"):
    g = torch.Generator().manual_seed(11)
    k_heads = K_HEADS if family == "qwen3_5" else V_HEADS  # Kimi: as many key heads as value heads
    query = torch.randn(BATCH, seq_len, k_heads, D_K, generator=g)
    key = torch.randn(BATCH, seq_len, k_heads, D_K, generator=g)
    value = torch.randn(BATCH, seq_len, V_HEADS, D_V, generator=g)
    per = () if family == "qwen3_5" else (D_K,)  # Kimi decays each key channel apart
    decay = -torch.rand(BATCH, seq_len, V_HEADS, *per, generator=g)  # log space, <= 0
    beta = torch.rand(BATCH, seq_len, V_HEADS, generator=g)
    grad = torch.randn(BATCH, seq_len, V_HEADS, D_V, generator=g)
    return (query, key, value, decay, beta), grad


def _close(mine, full, what):
    assert torch.allclose(mine, full, rtol=RTOL, atol=ATOL), f"{what}: off by {(mine - full).abs().max().item()}"


def check_rule(layout: str, family: str):
    rule = _rule(family)
    cp = ContextParallel(dist.group.WORLD, layout=layout)
    inputs, grad = _inputs(8 * cp.size, family)
    full = [t.clone().requires_grad_() for t in inputs]
    expected, _ = rule(*full, use_qk_l2norm_in_kernel=True)
    expected_grads = torch.autograd.grad(expected, full, grad)
    local = [cp.shard(t).requires_grad_() for t in inputs]
    token = active.set(cp)
    try:
        out, state = rule(*local, use_qk_l2norm_in_kernel=True)
    finally:
        active.reset(token)
    assert state is None
    _close(out, cp.shard(expected.detach()), f"{family} {layout} output")
    for name, mine, whole in zip(("query", "key", "value", "decay", "beta"), torch.autograd.grad(out, local,
                                                                                                cp.shard(grad)),
                                 expected_grads):
        _close(mine, cp.shard(whole), f"{family} {layout} d{name}")
    return True


def check_conv(layout: str):
    conv = _modeling().causal_conv1d_fn
    cp = ContextParallel(dist.group.WORLD, layout=layout)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(BATCH, 6, 4 * cp.size, generator=g, dtype=torch.float64)  # [b, channels, s]
    weight = torch.randn(6, 4, generator=g, dtype=torch.float64)  # kernel 4: halos reach over whole chunks of 2
    full = x.clone().requires_grad_()
    expected = conv(full, weight, None, activation="silu")
    local = cp.shard(x, dim=2).requires_grad_()
    token = active.set(cp)
    try:
        out = conv(local, weight, None, activation="silu")
    finally:
        active.reset(token)
    grad = torch.randn(expected.shape, generator=g, dtype=torch.float64)
    (full_grad,) = torch.autograd.grad(expected, full, grad)
    (local_grad,) = torch.autograd.grad(out, local, cp.shard(grad, dim=2))
    assert torch.allclose(out, cp.shard(expected.detach(), dim=2), rtol=1e-12, atol=1e-12)
    # Each rank's input gradient: its own tokens' outputs plus the halos other ranks read, reduce-scattered.
    assert torch.allclose(local_grad, cp.shard(full_grad, dim=2), rtol=1e-12, atol=1e-12)
    return True


def check_dynamic_conv(layout: str):
    """Inkling 2's short convolution with per-token taps (projected from a second input along the
    sequence, which gets its halo too), run on each chunk with the tokens before it (halo.py)."""
    from transformers.models.inkling2.modeling_inkling2 import Inkling2DynamicShortConvolution

    cp = ContextParallel(dist.group.WORLD, layout=layout)
    torch.manual_seed(5)
    whole = Inkling2DynamicShortConvolution(hidden_size=8, input_size=6, num_heads=2, conv_kernel_size=4,
                                            layer_idx=0, conv_idx=0)
    torch.nn.init.normal_(whole.static_weight)
    sharded = copy.deepcopy(whole)
    assert apply_halos(sharded, cp) == 1
    seq = 4 * cp.size  # kernel 4 at cp=4: halos reach over whole chunks of 2
    x, taps_from, grad = torch.randn(BATCH, seq, 8), torch.randn(BATCH, seq, 6), torch.randn(BATCH, seq, 8)
    full = [x.clone().requires_grad_(), taps_from.clone().requires_grad_()]
    expected = whole(*full)
    local = [cp.shard(t).requires_grad_() for t in (x, taps_from)]
    out = sharded(*local)
    _close(out, cp.shard(expected.detach()), f"dynamic conv {layout} output")
    params = [sharded.static_weight, sharded.weight_proj.weight]
    mine = torch.autograd.grad(out, local + params, cp.shard(grad))
    wholes = torch.autograd.grad(expected, full + [whole.static_weight, whole.weight_proj.weight], grad)
    for name, got, want in zip(("x", "dynamic_input"), mine, wholes):
        _close(got, cp.shard(want), f"dynamic conv {layout} d{name}")  # halos' gradients reduce-scattered back
    for name, got, want in zip(("static_weight", "weight_proj"), mine[2:], wholes[2:]):
        dist.all_reduce(got)
        _close(got, want, f"dynamic conv {layout} d{name}")
    return True


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("family", ["qwen3_5", "kimi"])
def test_delta_rule_over_shards_equals_the_whole_sequence(ranks, cp, layout, family):
    assert ranks(cp).run(check_rule, layout, family) == [True] * cp


def check_mamba2_scan(layout: str):
    from transformers.models.mamba2 import modeling_mamba2

    wrap_mamba2_modeling(modeling_mamba2)  # calls through unless a sharded layer is running
    scan = modeling_mamba2.mamba2_chunk_scan
    cp = ContextParallel(dist.group.WORLD, layout=layout)
    seq, heads, head_dim, groups, d_state = 8 * cp.size, 4, 6, 2, 8
    g = torch.Generator().manual_seed(3)
    x = torch.randn(BATCH, seq, heads, head_dim, generator=g)
    dt = torch.randn(BATCH, seq, heads, generator=g)
    b, c = (torch.randn(BATCH, seq, groups, d_state, generator=g) for _ in range(2))
    a = -torch.rand(heads, generator=g) - 0.5
    d, dt_bias = torch.randn(heads, generator=g), torch.randn(heads, generator=g)
    grad = torch.randn(BATCH, seq, heads, head_dim, generator=g)
    extra = dict(D=d, dt_bias=dt_bias, dt_softplus=True)
    full = [t.clone().requires_grad_() for t in (x, dt, b, c)]
    expected = scan(full[0], full[1], a, full[2], full[3], 4, **extra)  # chunks of 4: several per shard at cp=2
    expected_grads = torch.autograd.grad(expected, full, grad)
    local = [cp.shard(t).requires_grad_() for t in (x, dt, b, c)]
    token = active.set(cp)
    try:
        out = scan(local[0], local[1], a, local[2], local[3], 4, **extra)
    finally:
        active.reset(token)
    _close(out, cp.shard(expected.detach()), f"mamba2 {layout} output")
    for name, mine, whole in zip(("x", "dt", "B", "C"), torch.autograd.grad(out, local, cp.shard(grad)),
                                 expected_grads):
        _close(mine, cp.shard(whole), f"mamba2 {layout} d{name}")
    return True


def _mamba1():
    from transformers.models.mamba import modeling_mamba

    wrap_mamba1_modeling(modeling_mamba)  # calls through unless a sharded layer is running
    return modeling_mamba


def check_selective_scan(layout: str):
    scan = _mamba1().mamba_selective_scan
    cp = ContextParallel(dist.group.WORLD, layout=layout)
    seq, channels, d_state = 6 * cp.size, 5, 4
    g = torch.Generator().manual_seed(7)
    x, dt, z = (torch.randn(BATCH, channels, seq, generator=g) for _ in range(3))
    b, c = (torch.randn(BATCH, d_state, seq, generator=g) for _ in range(2))
    a = -torch.rand(channels, d_state, generator=g) - 0.1
    d, bias = torch.randn(channels, generator=g), torch.randn(channels, generator=g)
    grad = torch.randn(BATCH, channels, seq, generator=g)
    sequence, parameters = (x, dt, b, c, z), (a, d, bias)
    full, full_params = ([t.clone().requires_grad_() for t in ts] for ts in (sequence, parameters))
    expected = scan(*full[:2], full_params[0], *full[2:4], D=full_params[1], z=full[4], delta_bias=full_params[2],
                    delta_softplus=True)
    expected_grads = torch.autograd.grad(expected, full + full_params, grad)
    local = [cp.shard(t, dim=2).requires_grad_() for t in sequence]
    params = [t.clone().requires_grad_() for t in parameters]
    token = active.set(cp)
    try:
        out = scan(*local[:2], params[0], *local[2:4], D=params[1], z=local[4], delta_bias=params[2],
                   delta_softplus=True)
    finally:
        active.reset(token)
    _close(out, cp.shard(expected.detach(), dim=2), f"selective scan {layout} output")
    grads = torch.autograd.grad(out, local + params, cp.shard(grad, dim=2))
    for name, mine, whole in zip(("x", "dt", "B", "C", "z"), grads, expected_grads):
        _close(mine, cp.shard(whole, dim=2), f"selective scan {layout} d{name}")
    for name, mine, whole in zip(("A", "D", "delta_bias"), grads[5:], expected_grads[5:]):
        dist.all_reduce(mine)  # each rank holds its tokens' share of a parameter's gradient
        _close(mine, whole, f"selective scan {layout} d{name}")
    return True


def check_packed_offsets_refused():
    """Packed sequences described by offsets into the whole sequence (flash-style cu_seqlens, Mamba's
    seq_idx) would be misread by a chunk's run: refused, naming them."""
    from transformers.models.mamba2 import modeling_mamba2

    wrap_mamba2_modeling(modeling_mamba2)
    cp = ContextParallel(dist.group.WORLD)
    inputs, _ = _inputs(8 * cp.size)
    local = [cp.shard(t) for t in inputs]
    token = active.set(cp)
    try:
        with pytest.raises(NotImplementedError, match="a gated delta-rule layer was given cu_seqlens"):
            _rule("qwen3_5")(*local, cu_seqlens=torch.tensor([0, 5, 16]))
        with pytest.raises(NotImplementedError, match="a short convolution was given seq_idx"):
            modeling_mamba2.causal_conv1d_fn(torch.zeros(1, 2, 8), torch.zeros(2, 4), seq_idx=torch.zeros(1, 8))
        with pytest.raises(NotImplementedError, match="a selective scan asked for its last state"):
            _mamba1().mamba_selective_scan(*(torch.zeros(1, 2, 8),) * 2, torch.zeros(2, 3),
                                           *(torch.zeros(1, 3, 8),) * 2, return_last_state=True)
    finally:
        active.reset(token)
    return True


def test_packed_offsets_are_refused(ranks):
    assert ranks(2).run(check_packed_offsets_refused) == [True, True]


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_mamba2_scan_over_shards_equals_the_whole_sequence(ranks, cp, layout):
    assert ranks(cp).run(check_mamba2_scan, layout) == [True] * cp


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_selective_scan_over_shards_equals_the_whole_sequence(ranks, cp, layout):
    assert ranks(cp).run(check_selective_scan, layout) == [True] * cp


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_short_convolution_with_halos_equals_the_whole_sequence(ranks, layout):
    assert ranks(4).run(check_conv, layout) == [True] * 4


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_convolution_with_per_token_taps_with_halos_equals_the_whole_sequence(ranks, layout):
    assert ranks(4).run(check_dynamic_conv, layout) == [True] * 4
