"""The zero-bubble automatic scheduler against the handcrafted schedules."""
import pytest

from torchpp import schedule as S

UNEVEN = dict(f=1.0, i=1.2, w=0.8, comm=0.1)


def max_span(sim):
    return max(e - s for s, e in zip(sim.span_start, sim.span_end))


@pytest.mark.parametrize("p,m", [(2, 2), (2, 8), (4, 4), (4, 8), (4, 12), (8, 8), (8, 24), (16, 48)])
@pytest.mark.parametrize("costs", [dict(f=1.0, i=1.0, w=1.0, comm=0.0), UNEVEN])
def test_memory_p_never_worse_than_zb_h1(p, m, costs):
    auto = S.generate("zb-auto", p, m, costs=costs, memory_limit=p)
    auto_sim, h1_sim = S.simulate(auto, **costs), S.simulate(S.generate("zb-h1", p, m), **costs)
    assert max(auto_sim.peak_activations) <= p
    assert max_span(auto_sim) <= max_span(h1_sim) + 1e-9
    assert auto_sim.bubble_ratio <= h1_sim.bubble_ratio + 1e-9


@pytest.mark.parametrize("p,m", [(2, 6), (4, 12), (4, 20), (8, 24), (8, 32), (16, 48)])
def test_memory_2p_bubble_under_one_percent(p, m):
    sim = S.simulate(S.generate("zb-auto", p, m, memory_limit=2 * p))
    assert max(sim.peak_activations) <= 2 * p
    assert sim.bubble_ratio < 0.01


@pytest.mark.parametrize("p,m", [(4, 12), (8, 24)])
def test_uneven_costs_reported_and_better_than_1f1b(p, m):
    """F=1, I=1.2, W=0.8, comm=0.1: the searched schedule beats 1F1B and ZB-H1."""
    sims = {name: S.simulate(S.generate(name, p, m, costs=UNEVEN, memory_limit=2 * p if name == "zb-auto" else None),
                             **UNEVEN)
            for name in ["1f1b", "zb-h1", "zb-auto"]}
    print({name: round(sim.bubble_ratio, 4) for name, sim in sims.items()})
    assert sims["zb-auto"].bubble_ratio < sims["zb-h1"].bubble_ratio < sims["1f1b"].bubble_ratio
    assert max(sims["zb-auto"].peak_activations) <= 2 * p


def test_memory_limit_is_respected_below_p():
    sim = S.simulate(S.generate("zb-auto", 8, 16, memory_limit=3))
    assert max(sim.peak_activations) <= 3


def test_memory_limit_below_one_is_refused():
    with pytest.raises(ValueError, match="memory_limit >= 1"):
        S.generate("zb-auto", 4, 8, memory_limit=0.5)
