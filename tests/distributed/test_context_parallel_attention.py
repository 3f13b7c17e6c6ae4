"""Context-parallel attention (torch.ops.torchpp.ring_attention / all_gather_attention /
all_to_all_attention / all_to_all_ring_attention) on spawned gloo ranks: each rank's output and its q, k, v
gradients equal its shard of full-sequence SDPA (fp64, 1e-10), at cp=2 and cp=4, causal and full, the four
modes (the all-to-all's key/value heads repeated where c does not divide them: 2 and 1 heads at cp=4;
hierarchical: all-to-all groups of 2, the ring across 1 or 2 of them), both layouts, grouped-query
attention and packed sequences, sliding windows (causal, and bidirectional: |i - j| < window), attention sinks and capped scores (against the
softmax written out, the sinks' gradient summed over the ranks); bad lengths, layouts and modes
raise naming the values. Blocks run on the CPU flash kernel (which returns the log-sum-exp) except
where a mask it cannot take applies (packed sequences) or scores are capped: matmul + softmax;
TORCHPP_CP_KERNEL=matmul forces that path. Every mode under torch.compile (fullgraph, aot_eager) at cp=2
and cp=4; the heads-for-sequence exchange ops (heads_to_sequence / sequence_to_heads) on their own; torch.library.opcheck
on every op."""
import itertools
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from torchpp.context_parallel import (attention, hierarchical_groups, sequence_positions, shard_sequence,
                                      unshard_sequence)

TOL = 1e-10
BATCH, HEADS, HEAD_DIM = 2, 4, 8
MODES = ("ring", "all-gather", "all-to-all", "all-to-all+ring")
_HIERARCHICAL = {}


def _group_of(mode: str, group):
    """The op's group(s): for all-to-all+ring, all-to-all groups of 2 ranks (1 at cp=1) and the ring
    across them (made once per process: every rank makes them in the same call)."""
    if mode != "all-to-all+ring":
        return group
    a = min(2, group.size())
    if a not in _HIERARCHICAL:
        _HIERARCHICAL[a] = hierarchical_groups(a, group)
    return _HIERARCHICAL[a]


def _inputs(seq_len: int, kv_heads: int, value_dim: int = HEAD_DIM):
    g = torch.Generator().manual_seed(7)
    q = torch.randn(BATCH, HEADS, seq_len, HEAD_DIM, generator=g, dtype=torch.float64)
    k = torch.randn(BATCH, kv_heads, seq_len, HEAD_DIM, generator=g, dtype=torch.float64)
    v = torch.randn(BATCH, kv_heads, seq_len, value_dim, generator=g, dtype=torch.float64)
    grad = torch.randn(BATCH, HEADS, seq_len, value_dim, generator=g, dtype=torch.float64)
    return q, k, v, grad


def _segments(seq_len: int) -> torch.Tensor:
    """Packed rows: sequences of uneven lengths whose boundaries fall inside chunks and across them."""
    cuts = [[3, 7, seq_len - 2], [seq_len // 2 + 1]]
    rows = []
    for row in cuts:
        ids = torch.zeros(seq_len, dtype=torch.long)
        for cut in row:
            ids[cut:] += 1
        rows.append(ids)
    return torch.stack(rows)


def _reference(q, k, v, grad, causal, segments, window=None, sinks=None, softcap=None, alibi=None):
    """Full-sequence attention: SDPA, or with a window, sinks, a score cap or ALiBi softmax written
    out (a sink is one more logit per head in the denominator; capped scores are softcap *
    tanh(s / softcap), as Gemma 2's; ALiBi adds slope_h * key index, as Bloom's, which differs
    from the op's slope_h * (j - i) by a constant per row): output, then the gradients of q, k, v
    (and sinks)."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    mask = None
    if segments is not None:
        mask = segments[:, None, :, None] == segments[:, None, None, :]
        if causal:
            mask = mask & torch.ones(q.size(2), q.size(2), dtype=torch.bool).tril()
    if window is None and sinks is None and softcap is None and alibi is None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None,
                                             enable_gqa=True)
        return (out.detach(), *torch.autograd.grad(out, (q, k, v), grad))
    s = q.size(2)
    position = torch.arange(s)
    allowed = position[None, :] <= position[:, None] if causal else torch.ones(s, s, dtype=torch.bool)
    if window is not None:  # (without causality the window reaches ahead as far: |i - j| < window)
        distance = position[:, None] - position[None, :]
        allowed = allowed & ((distance if causal else distance.abs()) < window)
    allowed = allowed if mask is None else mask & allowed
    groups = q.size(1) // k.size(1)
    keys, values = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = q @ keys.transpose(-1, -2) / q.size(-1) ** 0.5
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if alibi is not None:
        scores = scores + alibi.view(1, -1, 1, 1) * position.view(1, 1, 1, s)
    scores = scores.masked_fill(~allowed, float("-inf"))
    inputs = (q, k, v)
    if sinks is not None:
        sinks = sinks.clone().requires_grad_()
        inputs += (sinks,)
        scores = torch.cat([scores, sinks.view(1, -1, 1, 1).expand(q.size(0), -1, s, 1)], dim=-1)
    probs = scores.softmax(-1)[..., :s]
    out = probs @ values
    return (out.detach(), *torch.autograd.grad(out, inputs, grad))


# Other dtypes (tests/gpu): error relative to the largest entry. bf16 at 5e-2: its kernels round P and
# dP to 8 bits, and the backward's dS = P (dP - delta) loses relative precision in the difference.
RELATIVE_TOL = {torch.float32: 1e-5, torch.bfloat16: 5e-2, torch.float16: 1e-2}


def _check_case(seq_len, kv_heads, mode, layout, causal, packed, device=torch.device("cpu"), dtype=torch.float64,
                window=None, sinks=False, softcap=None, alibi=False, value_dim=HEAD_DIM, compiled=False):
    """The sharded attention on `device` in `dtype` against full-sequence attention in float64 (on
    the same inputs, rounded to `dtype`); with `sinks`, their gradient summed over the ranks;
    `compiled`: the call torch.compile'd whole (fullgraph, aot_eager: autograd traced ahead)."""
    group = dist.group.WORLD
    q, k, v, grad = (t.to(dtype).double() for t in _inputs(seq_len, kv_heads, value_dim))
    segments = _segments(seq_len) if packed else None
    sink_logits = torch.linspace(-1.0, 2.0, HEADS, dtype=dtype).double() if sinks else None
    # ALiBi's slopes as Bloom's for 4 heads (2^-2, 2^-4, ...), steep enough to reshape the softmax.
    slopes = 2.0 ** -(2.0 * torch.arange(1, HEADS + 1, dtype=torch.float64)) if alibi else None
    expected = _reference(q, k, v, grad, causal, segments, window, sink_logits, softcap, slopes)
    shard = lambda t: shard_sequence(t, group, dim=2, layout=layout)  # noqa: E731
    local = lambda t: shard(t).to(device, dtype)  # noqa: E731
    ql, kl, vl = (local(t).requires_grad_() for t in (q, k, v))
    inputs = (ql, kl, vl)
    local_sinks = None
    if sinks:
        local_sinks = sink_logits.to(device, dtype).requires_grad_()
        inputs += (local_sinks,)
    local_segments = shard_sequence(segments, group, dim=1, layout=layout).to(device) if packed else None
    if compiled:
        torch._dynamo.reset()  # (a fresh trace per case: no cache limit falls back to eager)
    attend = torch.compile(attention, backend="aot_eager", fullgraph=True) if compiled else attention
    out = attend(ql, kl, vl, _group_of(mode, group), causal=causal, mode=mode, layout=layout,
                    segment_ids=local_segments,
                    window=window, sinks=local_sinks, softcap=softcap,
                    alibi_slopes=None if slopes is None else slopes.to(device, dtype))
    got = [out.detach(), *torch.autograd.grad(out, inputs, local(grad))]
    if sinks:  # each rank's queries' share
        dist.all_reduce(got[4], group=group)
    names = ("output", "dq", "dk", "dv", "dsinks")
    for name, mine, full in zip(names, got, expected):
        tol = TOL if dtype == torch.float64 else RELATIVE_TOL[dtype] * full.abs().max().item()
        assert mine.dtype == dtype, f"{name} came back in {mine.dtype}"
        error = (mine.cpu().double() - (full if name == "dsinks" else shard(full))).abs().max().item()
        assert error <= tol, (f"{mode} {layout} causal={causal} packed={packed} kv_heads={kv_heads} window={window} "
                             f"sinks={sinks} softcap={softcap} alibi={alibi} value_dim={value_dim} {dtype} on "
                             f"{device}: {name} off by "
                             f"{error} (tolerance {tol})")
    if dtype == torch.float64:
        assert (unshard_sequence(out.detach(), group, dim=2, layout=layout).cpu() - expected[0]).abs().max() < TOL


def check_all_cases(seq_len, device=torch.device("cpu"), dtype=torch.float64):
    for mode, layout, causal in itertools.product(MODES, ("zigzag", "contiguous"), (True, False)):
        _check_case(seq_len, kv_heads=2, mode=mode, layout=layout, causal=causal, packed=False, device=device,
                    dtype=dtype)
    for mode in MODES:  # as many key/value heads as queries: cuDNN's blocks where SDPA picks it
        _check_case(seq_len, kv_heads=HEADS, mode=mode, layout="zigzag", causal=True, packed=False, device=device,
                    dtype=dtype)
    for mode, causal in itertools.product(MODES, (True, False)):  # MQA, packed
        _check_case(seq_len, kv_heads=1, mode=mode, layout="zigzag", causal=causal, packed=True, device=device,
                    dtype=dtype)
    _check_case(seq_len, kv_heads=HEADS, mode="ring", layout="contiguous", causal=True, packed=True, device=device,
                dtype=dtype)
    # Sliding windows narrower than a chunk (cut through the diagonal blocks), about two chunks wide
    # (blocks wholly behind them skipped), on packed rows too; attention sinks with and without them.
    chunk = seq_len // (2 * dist.get_world_size())
    for mode, layout, window, sinks in itertools.product(MODES, ("zigzag", "contiguous"),
                                                         (max(chunk - 1, 1), 2 * chunk + 1), (False, True)):
        _check_case(seq_len, kv_heads=2, mode=mode, layout=layout, causal=True, packed=False, device=device,
                    dtype=dtype, window=window, sinks=sinks)
    for mode in MODES:
        _check_case(seq_len, kv_heads=1, mode=mode, layout="zigzag", causal=True, packed=True, device=device,
                    dtype=dtype, window=chunk + 1, sinks=True)
        _check_case(seq_len, kv_heads=2, mode=mode, layout="zigzag", causal=False, packed=False, device=device,
                    dtype=dtype, sinks=True)
    # Bidirectional windows (|i - j| < window: EmbeddingGemma2's), cutting through blocks ahead too,
    # and skipping those wholly beyond; on packed rows with sinks.
    for mode, layout, window in itertools.product(MODES, ("zigzag", "contiguous"), (max(chunk - 1, 1), 2 * chunk + 1)):
        _check_case(seq_len, kv_heads=2, mode=mode, layout=layout, causal=False, packed=False, device=device,
                    dtype=dtype, window=window)
    for mode in MODES:
        _check_case(seq_len, kv_heads=1, mode=mode, layout="zigzag", causal=False, packed=True, device=device,
                    dtype=dtype, window=chunk + 1, sinks=True)
    # Capped scores (a cap of 1 bends these scores, about N(0, 1), markedly): causal and full, with a
    # window and sinks, on packed rows.
    for mode, layout, causal in itertools.product(MODES, ("zigzag", "contiguous"), (True, False)):
        _check_case(seq_len, kv_heads=2, mode=mode, layout=layout, causal=causal, packed=False, device=device,
                    dtype=dtype, softcap=1.0)
    for mode in MODES:
        _check_case(seq_len, kv_heads=1, mode=mode, layout="zigzag", causal=True, packed=True, device=device,
                    dtype=dtype, window=chunk + 1, sinks=True, softcap=1.0)
    # ALiBi (Bloom, MPT): causal and full, grouped and multi-query heads, on packed rows and with a window.
    for mode, layout, causal in itertools.product(MODES, ("zigzag", "contiguous"), (True, False)):
        _check_case(seq_len, kv_heads=2, mode=mode, layout=layout, causal=causal, packed=False, device=device,
                    dtype=dtype, alibi=True)
    for mode in MODES:
        _check_case(seq_len, kv_heads=1, mode=mode, layout="zigzag", causal=True, packed=True, device=device,
                    dtype=dtype, window=chunk + 1, alibi=True)
    # Values narrower (with a window and sinks) and wider (packed rows) than the keys, as MLA's.
    for mode, value_dim in (("ring", HEAD_DIM - 3), ("all-gather", HEAD_DIM + 4), ("all-to-all", HEAD_DIM - 3),
                            ("all-to-all", HEAD_DIM + 4), ("all-to-all+ring", HEAD_DIM - 3)):
        _check_case(seq_len, kv_heads=2, mode=mode, layout="zigzag", causal=True, packed=value_dim > HEAD_DIM,
                    device=device, dtype=dtype, window=chunk + 1 if value_dim < HEAD_DIM else None,
                    sinks=value_dim < HEAD_DIM, value_dim=value_dim)
    return True


def check_compiled_cases(seq_len, device=torch.device("cpu"), dtype=torch.float64):
    """Each mode under torch.compile: causal and full, both layouts, packed rows with a window and sinks."""
    for mode in MODES:
        _check_case(seq_len, kv_heads=2, mode=mode, layout="zigzag", causal=True, packed=False, device=device,
                    dtype=dtype, compiled=True)
        _check_case(seq_len, kv_heads=2, mode=mode, layout="contiguous", causal=False, packed=False, device=device,
                    dtype=dtype, compiled=True)
        _check_case(seq_len, kv_heads=1, mode=mode, layout="zigzag", causal=True, packed=True, device=device,
                    dtype=dtype, window=3, sinks=True, compiled=True)
    return True


def check_head_exchange():
    """heads_to_sequence hands rank r heads [r H/c, (r+1) H/c) of the whole sequence, sequence_to_heads
    hands them back, and each one's gradient is the other; bad sizes raise naming them."""
    group = dist.group.WORLD
    c, r = group.size(), group.rank()
    whole = torch.randn(2, 2 * c, 4 * c, 3, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    heads = slice(r * 2, (r + 1) * 2)
    for layout in ("zigzag", "contiguous"):
        shard = shard_sequence(whole, group, dim=2, layout=layout).requires_grad_()
        mine = torch.ops.torchpp.heads_to_sequence(shard, group.group_name, c, layout)
        assert torch.equal(mine, whole[:, heads]), layout
        assert torch.equal(torch.ops.torchpp.sequence_to_heads(mine, group.group_name, c, layout), shard), layout
        grad = torch.randn_like(mine)
        placed = torch.zeros_like(whole)
        placed[:, heads] = grad
        dist.all_reduce(placed, group=group)  # (each rank's heads' gradient lands on every rank's shard)
        expected = shard_sequence(placed, group, dim=2, layout=layout)
        assert torch.equal(torch.autograd.grad(mine, shard, grad)[0], expected), layout
    with pytest.raises(RuntimeError, match=rf"heads_to_sequence: each rank keeps 1/c of the heads, but 3 heads do "
                                           rf"not divide over c={c} ranks"):
        torch.ops.torchpp.heads_to_sequence(torch.zeros(1, 3, 4, 2), group.group_name, c)
    with pytest.raises(RuntimeError, match=rf"sequence_to_heads: the sequence of 6 tokens does not divide into the "
                                           rf"{2 * c} chunks of c={c} ranks \(layout 'zigzag'\)"):
        torch.ops.torchpp.sequence_to_heads(torch.zeros(1, 2, 6, 2), group.group_name, c, "zigzag")
    return True

def check_opcheck():
    """torch.library.opcheck on every cp op, with and without sinks, and on the exchanges: schemas
    (no undeclared aliasing or mutation, none handing back its input), fake kernels against the real
    ones, autograd registration, and AOT dispatch with static and dynamic shapes."""
    group = dist.group.WORLD
    name, c = group.group_name, group.size()
    # Laid out [b, s, heads, d] in memory, as transformers' attention hands them over (q.transpose(1, 2)):
    # the fake kernels' strides must still be the real ones'.
    q, k, v, _ = (shard_sequence(t, group, dim=2).transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
                  for t in _inputs(4 * c, kv_heads=2))
    sinks = torch.linspace(-1.0, 1.0, HEADS, dtype=torch.float64).requires_grad_()
    inner, ring = _group_of("all-to-all+ring", group)
    for op, groups in (("ring_attention", (name, c)), ("all_gather_attention", (name, c)),
                       ("all_to_all_attention", (name, c)),
                       ("all_to_all_ring_attention", (inner.group_name, inner.size(), ring.group_name, ring.size()))):
        for extra in ({}, {"sinks": sinks}):
            torch.library.opcheck(getattr(torch.ops.torchpp, op).default, (q, k, v, None, *groups), extra)
    torch.library.opcheck(torch.ops.torchpp.heads_to_sequence.default, (q, name, c, "zigzag"))
    whole = torch.randn(2, 2, 4 * c, 3, dtype=torch.float64, requires_grad=True)
    torch.library.opcheck(torch.ops.torchpp.sequence_to_heads.default, (whole, name, c, "contiguous"))
    return True

def check_errors():
    group = dist.group.WORLD
    c = group.size()
    with pytest.raises(ValueError, match=rf"cuts the sequence into 2c = {2 * c} .* its length 6 is not divisible by 4"):
        shard_sequence(torch.zeros(1, 6), group, layout="zigzag")
    with pytest.raises(ValueError, match="length 5 is not divisible by 2"):
        shard_sequence(torch.zeros(1, 5), group, layout="contiguous")
    with pytest.raises(ValueError, match="length 6 is not divisible by 4"):
        sequence_positions(6, group)
    q = torch.zeros(1, 2, 3, 4, dtype=torch.float64)  # an odd zigzag shard
    for mode in MODES:
        with pytest.raises(RuntimeError, match=r"2c = 4 chunks.* has 3 tokens \(a sequence of 6 tokens"):
            attention(q, q, q, _group_of(mode, group), mode=mode)
    with pytest.raises(RuntimeError, match=r"all_to_all_attention: .* 3 query heads do not divide over 2 ranks"):
        attention(torch.zeros(1, 3, 4, 4), torch.zeros(1, 1, 4, 4), torch.zeros(1, 1, 4, 4), group, mode="all-to-all")
    with pytest.raises(RuntimeError, match=r"all_to_all_ring_attention: .* 3 query heads do not divide over a=2"):
        attention(torch.zeros(1, 3, 4, 4), torch.zeros(1, 1, 4, 4), torch.zeros(1, 1, 4, 4),
                  _group_of("all-to-all+ring", group), mode="all-to-all+ring")
    with pytest.raises(ValueError, match=r"'all-to-all\+ring' takes group=\(all-to-all group, ring group\)"):
        attention(q, q, q, group, mode="all-to-all+ring")
    with pytest.raises(ValueError, match=rf"size must divide {c}, got all_to_all_size=3"):
        hierarchical_groups(3, group)
    with pytest.raises(ValueError, match=r"groups of different sizes \['1', '2'\]; every rank must pass the same"):
        hierarchical_groups(1 + dist.get_rank() % 2, group)  # (raised on every rank: none waits for a group)
    with pytest.raises(RuntimeError, match="query heads 3 must be a multiple of key/value heads 2"):
        attention(torch.zeros(1, 3, 4, 4), torch.zeros(1, 2, 4, 4), torch.zeros(1, 2, 4, 4), group)
    with pytest.raises(RuntimeError, match=r"segment_ids must be \[batch, s_local\] = \[1, 4\]"):
        attention(torch.zeros(1, 2, 4, 4), torch.zeros(1, 2, 4, 4), torch.zeros(1, 2, 4, 4), group,
                  segment_ids=torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="mode must be one of .* got 'ulysses'"):
        attention(q, q, q, group, mode="ulysses")
    with pytest.raises(ValueError, match="layout must be one of .* got 'striped'"):
        attention(q, q, q, group, layout="striped")
    q4 = torch.zeros(1, 2, 4, 4)
    with pytest.raises(ValueError, match="window must be positive .* got 0"):
        attention(q4, q4, q4, group, window=0)
    with pytest.raises(ValueError, match="softcap must be positive .* got -1.0"):
        attention(q4, q4, q4, group, softcap=-1.0)
    with pytest.raises(RuntimeError, match="softcap must be positive and finite .* got inf"):
        attention(q4, q4, q4, group, softcap=float("inf"))
    for mode in MODES:
        with pytest.raises(RuntimeError, match=r"sinks must hold one logit per query head, \[2\], got \[3\]"):
            attention(q4, q4, q4, _group_of(mode, group), mode=mode, sinks=torch.zeros(3))
    return True


def test_bad_lengths_and_names_raise(ranks):
    assert ranks(2).run(check_errors) == [True, True]


@pytest.mark.parametrize("cp", [2, 4])
def test_attention_equals_full_sequence_sdpa(ranks, cp):
    assert ranks(cp).run(check_all_cases, 4 * cp) == [True] * cp


@pytest.mark.parametrize("cp", [2, 4])
def test_compiled_attention_equals_full_sequence_sdpa(ranks, cp):
    """torch.compile traces every mode whole: the ring's and all-gather's halves and the all-to-all
    modes' exchanges are ops of their own (tracing into c10d's in-place collectives dropped their
    writes: the all-to-all returned uninitialised memory)."""
    assert ranks(cp).run(check_compiled_cases, 4 * cp) == [True] * cp


def test_opcheck(ranks):
    assert ranks(2).run(check_opcheck) == [True, True]

def test_head_exchange_ops(ranks):
    assert ranks(2).run(check_head_exchange) == [True, True]

def test_one_rank_equals_sdpa_in_its_input_dtype(ranks):
    """cp=1 sends nothing (no key/value message, gradients joined from their pieces) and bf16
    blocks keep the kernel's dtype until a second block merges: both against float64 SDPA."""
    assert ranks(1).run(check_all_cases, 8) == [True]
    assert ranks(1).run(check_all_cases, 8, torch.device("cpu"), torch.bfloat16) == [True]


def test_bf16_ring_widens_what_it_merges_and_sends(ranks):
    # bf16 pieces of one block, widened pieces of two, and the float32 key/value gradient messages
    # assembled from both, at cp=2 (RELATIVE_TOL: the kernels round P to 8 bits).
    assert ranks(2).run(check_all_cases, 8, torch.device("cpu"), torch.bfloat16) == [True, True]


BLOCK_KERNELS = {"flash_cpu": "aten::_scaled_dot_product_flash_attention_for_cpu",
                 "cudnn": "aten::_scaled_dot_product_cudnn_attention",
                 "flash": "aten::_scaled_dot_product_flash_attention",
                 "efficient": "aten::_scaled_dot_product_efficient_attention"}


def _kernels_used(packed: bool, kernel: str = "flash_cpu", device=torch.device("cpu"),
                  dtype=torch.float64, kv_heads: int = 2, softcap=None, alibi: bool = False, mode: str = "ring") -> dict:
    """Profiler counts of a block kernel's forward and backward in one forward + backward of
    attention (ring by default)."""
    group = dist.group.WORLD
    q, k, v, grad = (t.to(device, dtype) for t in _inputs(8 * group.size(), kv_heads=kv_heads))
    segments = shard_sequence(_segments(q.size(2)), group, dim=1).to(device) if packed else None
    ql, kl, vl = (shard_sequence(t, group, dim=2).requires_grad_() for t in (q, k, v))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        slopes = torch.full((HEADS,), 0.25, device=device, dtype=dtype) if alibi else None
        out = attention(ql, kl, vl, group, causal=True, segment_ids=segments, softcap=softcap, alibi_slopes=slopes,
                        mode=mode)
        out.backward(shard_sequence(grad, group, dim=2))
    names = [event.name for event in prof.events()]
    return {kind: sum(name == f"{BLOCK_KERNELS[kernel]}{kind}" for name in names) for kind in ("", "_backward")}


def check_block_kernels():
    flash = _kernels_used(packed=False)
    assert flash[""] > 0 and flash["_backward"] > 0, f"unmasked blocks did not run the flash kernel: {flash}"
    assert sum(_kernels_used(packed=True).values()) == 0, "packed blocks need their mask: matmul path"
    assert sum(_kernels_used(packed=False, softcap=2.0).values()) == 0, "capped scores take the matmul path"
    assert sum(_kernels_used(packed=False, alibi=True).values()) == 0, "ALiBi's biased scores take the matmul path"
    # All-to-all: this rank's heads over the whole sequence in one fused call each way.
    whole = _kernels_used(packed=False, mode="all-to-all")
    assert whole == {"": 1, "_backward": 1}, f"all-to-all attention did not run one flash call each way: {whole}"
    assert sum(_kernels_used(packed=True, mode="all-to-all").values()) == 0, "packed chunks need their mask"
    os.environ["TORCHPP_CP_KERNEL"] = "matmul"
    try:
        forced = _kernels_used(packed=False)
    finally:
        del os.environ["TORCHPP_CP_KERNEL"]
    assert sum(forced.values()) == 0, f"TORCHPP_CP_KERNEL=matmul still ran the flash kernel: {forced}"
    return True


def test_blocks_run_the_flash_kernel_unless_masked(ranks):
    assert ranks(2).run(check_block_kernels) == [True, True]

