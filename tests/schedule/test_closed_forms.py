"""Closed forms of SPEC.md section 3, exact in the simulator at F=I=W=1 (B=2), comm=0."""
import pytest

from torchpp import schedule as S

F, I, W = 1.0, 1.0, 1.0
B = I + W
SIZES = [(1, 1), (2, 4), (4, 8), (4, 12), (8, 16), (8, 24), (16, 32)]


def max_span(sim):
    return max(e - s for s, e in zip(sim.span_start, sim.span_end))


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", SIZES)
def test_gpipe_and_1f1b_bubble_and_makespan(name, p, m):
    sim = S.simulate(S.generate(name, num_ranks=p, num_microbatches=m), f=F, i=I, w=W)
    assert sim.makespan == (m + p - 1) * (F + B)
    assert sim.bubble == (p - 1) * (F + B)
    assert sim.bubble_ratio == pytest.approx((p - 1) * (F + B) / ((m + p - 1) * (F + B)))


@pytest.mark.parametrize("p,m", SIZES)
def test_activation_peaks_of_gpipe_and_1f1b(p, m):
    assert S.simulate(S.generate("gpipe", p, m)).peak_activations == [m] * p
    assert S.simulate(S.generate("1f1b", p, m)).peak_activations == [min(p - r, m) for r in range(p)]


@pytest.mark.parametrize("p,m", SIZES)
def test_zb_h1_bubble_and_peak(p, m):
    sim = S.simulate(S.generate("zb-h1", p, m), f=F, i=I, w=W)
    assert sim.bubble == (p - 1) * (F + I - W)
    if m >= p:
        assert sim.peak_activations[0] == p


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 12), (8, 16), (8, 40), (16, 32)])
def test_zb_h2_is_a_parallelogram(p, m):
    sim = S.simulate(S.generate("zb-h2", p, m), f=F, i=I, w=W)
    assert sim.bubble == (p - 1) * (F + I - 2 * W) == 0
    for r in range(p):  # rank r busy without a gap from r*F to r*F + m(F+B)
        assert sim.span_start[r] == r * F
        assert sim.span_end[r] == r * F + m * (F + B)
        assert sim.idle[r] == 0
    assert sim.peak_activations[0] == 2 * p - 1


@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 8, 2), (4, 8, 3), (4, 16, 4), (8, 16, 2), (8, 24, 3)])
def test_interleaved_bubble_per_chunk_costs(p, m, v):
    sim = S.simulate(S.generate("interleaved-1f1b", p, m, num_chunks=v), f=F, i=I, w=W)
    assert sim.bubble == (p - 1) * (F + B)
    assert sim.bubble / max(sim.busy) == pytest.approx((p - 1) / (v * m))
    assert max(sim.peak_activations) >= S.simulate(S.generate("1f1b", p, m)).peak_activations[0]


@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 8, 2), (4, 8, 3), (4, 16, 4), (4, 12, 2), (3, 9, 2)])
def test_interleaved_zb_fills_the_interleaved_bubble(p, m, v):
    """Rank r defers 2r W's (the interleaved skew): no bubble at F=I=W, activations unchanged."""
    zb = S.simulate(S.generate("interleaved-zb", p, m, num_chunks=v), f=F, i=I, w=W)
    interleaved = S.simulate(S.generate("interleaved-1f1b", p, m, num_chunks=v), f=F, i=I, w=W)
    assert zb.bubble == 0 < interleaved.bubble
    assert zb.peak_activations == interleaved.peak_activations
    assert zb.peak_weight_pending == [min(2 * r + 1, m * v) for r in range(p)]


@pytest.mark.parametrize("name,p,m", [("dualpipe", 4, 8), ("dualpipe", 8, 16), ("dualpipe", 8, 32),
                                      ("dualpipe-v", 4, 8), ("dualpipe-v", 8, 16), ("dualpipe-v", 4, 24)])
def test_dualpipe_below_zb_h1(name, p, m):
    dual = S.simulate(S.generate(name, p, m), f=F, i=I, w=W)
    zb = S.simulate(S.generate("zb-h1", p, m), f=F, i=I, w=W)
    assert dual.bubble_ratio < zb.bubble_ratio


@pytest.mark.parametrize("p,m", [(4, 8), (4, 12), (8, 24)])
def test_zb_v_zero_bubble_within_p_activations(p, m):
    sim = S.simulate(S.generate("zb-v", p, m), f=F, i=I, w=W)
    assert sim.bubble_ratio < S.simulate(S.generate("zb-h1", p, m)).bubble_ratio
    assert max(sim.peak_activations) <= 2 * p  # 2p half-model stages = p M_B of the whole model


def test_eager_1f1b_holds_more_than_1f1b_at_the_same_bubble():
    eager = S.simulate(S.generate("eager-1f1b", 4, 8))
    plain = S.simulate(S.generate("1f1b", 4, 8))
    assert eager.bubble == plain.bubble
    assert eager.peak_activations[0] > plain.peak_activations[0]
