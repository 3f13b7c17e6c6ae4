"""V-Half and V-Min (Qi et al. 2024, "Pipeline Parallelism with Controllable Memory"): the
paper's peak memory and bubbles, valid lowered schedules, and the memory-limited V generator
that spans V-Min ... zb-v.

The paper counts a microbatch's activations from its F until its W (W needs the layer inputs),
in microbatches of a rank's layers (both of its stages): the simulator measures the same with
M_W = M_B (``weight_pending=1``), in stages, so a rank's two stages count twice."""
import pytest

from torchpp import schedule as S

PAPER_UNITS = dict(activation=1.0, weight_pending=1.0)
RANKS = (2, 3, 4, 5, 6, 8, 12, 16)


def closed_memory(name, p):
    """The paper's peak activation memory, microbatches of a rank's layers."""
    return {"v-min": (p + 4) // 3, "v-half": (p + 2) // 2, "zb-v": p}[name]


def closed_bubble(name, p):
    """The paper's bubble time at F = I = W = 1 (bubble rate about 2p/3m and p/2m over 6m of work)."""
    return {"v-min": 4 * p, "v-half": 3 * p}[name]


def idle(sim):
    return max(e - s for s, e in zip(sim.span_start, sim.span_end)) - max(sim.busy)


@pytest.mark.parametrize("name", ["v-min", "v-half"])
@pytest.mark.parametrize("p", RANKS)
def test_peak_memory_is_the_papers(name, p):
    for m in (2 * p, 3 * p, 4 * p):
        sim = S.simulate(S.generate(name, p, m), **PAPER_UNITS)
        assert max(sim.peak_memory) == 2 * closed_memory(name, p), (p, m, sim.peak_memory)
        assert max(sim.peak_activations) <= 2 * closed_memory(name, p)


@pytest.mark.parametrize("name", ["v-min", "v-half"])
@pytest.mark.parametrize("p", RANKS)
def test_bubble_is_the_papers(name, p):
    """The bubble is a constant of p (warm-up and cool-down) within one microbatch's six
    passes of the paper's; the rate therefore falls as 1/m."""
    bubbles = {m: idle(S.simulate(S.generate(name, p, m))) for m in (2 * p, 3 * p, 4 * p)}
    assert len(set(bubbles.values())) == 1, bubbles
    assert abs(bubbles[2 * p] - closed_bubble(name, p)) <= 6, (bubbles, closed_bubble(name, p))


@pytest.mark.parametrize("p", (4, 6, 8, 12))
def test_memory_against_bubble_ordering(p):
    """Less memory costs bubble: V-Min < V-Half < zb-v in memory, the other way in bubble."""
    m = 3 * p
    sims = {name: S.simulate(S.generate(name, p, m), **PAPER_UNITS) for name in ("v-min", "v-half", "zb-v", "1f1b")}
    memory = {name: max(sim.peak_memory) for name, sim in sims.items()}
    bubble = {name: sim.bubble_ratio for name, sim in sims.items()}
    assert memory["v-min"] < memory["v-half"] < 2 * p <= memory["zb-v"]
    assert bubble["v-min"] > bubble["v-half"] > bubble["zb-v"]
    assert bubble["v-half"] < bubble["1f1b"]


@pytest.mark.parametrize("name", ["v-min", "v-half"])
@pytest.mark.parametrize("p,m", [(1, 3), (2, 1), (2, 3), (3, 2), (4, 1), (4, 3), (4, 9), (5, 7), (6, 12), (8, 5)])
def test_valid_and_lowered_for_any_m(name, p, m):
    sch = S.generate(name, p, m)
    sch.validate()
    assert sch.stage_to_rank == [s if s < p else 2 * p - 1 - s for s in range(2 * p)]
    sch.lowered().validate()
    sch.lowered(in_order=True).check_in_order_p2p()
    sim = S.simulate(sch, **PAPER_UNITS)
    assert max(sim.peak_memory) <= 2 * closed_memory(name, p)


def test_only_two_stages_per_rank():
    with pytest.raises(ValueError, match="num_chunks == 2"):
        S.generate("v-half", 4, 8, num_chunks=3)


@pytest.mark.parametrize("p", (4, 8))
@pytest.mark.parametrize("costs", [dict(f=1.0, i=1.0, w=1.0), dict(f=1.0, i=1.2, w=0.8, comm=0.1)])
def test_memory_limit_spans_v_min_to_zb_v(p, costs):
    """memory_limit on the V family: from V-Min's peak up to zb-v's default (2p M_B), every
    limit is kept, and a larger limit is never slower; at V-Min's memory the result is at
    least as fast as V-Min, at 2p M_B as fast as zb-v."""
    m = 3 * p
    units = dict(activation=1.0, weight_pending=0.5)

    def run(name, limit=None):
        sim = S.simulate(S.generate(name, p, m, costs=dict(costs, **units), memory_limit=limit), **costs, **units)
        return sim.makespan, max(sim.peak_memory)

    v_min, v_half, zb_v = run("v-min"), run("v-half"), run("zb-v")
    limits = sorted({v_min[1], v_half[1], (v_min[1] + 2 * p) / 2, 2.0 * p})
    previous = float("inf")
    for limit in limits:
        for name in ("zb-v", "v-half", "v-min"):
            makespan, peak = run(name, limit)
            assert peak <= limit + 1e-9, (name, limit)
            assert makespan <= previous + 1e-9, (name, limit)
        previous = makespan
        if limit == v_min[1]:
            assert makespan <= v_min[0] + 1e-9
    assert run("zb-v", 2.0 * p)[0] == pytest.approx(zb_v[0])


def test_memory_limit_below_v_min_trades_more_bubble():
    """Below V-Min's memory the list scheduler still fits the limit (down to both stages of a
    rank, 2 M_B), each step down slower; below 2 M_B the V cannot run and is refused."""
    p, m = 8, 24
    v_min = S.simulate(S.generate("v-min", p, m))
    previous = v_min.makespan
    for limit in (6.0, 4.0, 3.0, 2.0):
        sim = S.simulate(S.generate("v-min", p, m, memory_limit=limit))
        assert max(sim.peak_memory) <= limit < max(v_min.peak_memory)
        assert sim.makespan >= previous
        previous = sim.makespan
    with pytest.raises(ValueError, match=r"memory_limit >= 2 M_B = 2 .*memory_limit=1.5"):
        S.generate("v-half", p, m, memory_limit=1.5)
