"""The zero-bubble automatic scheduler against the handcrafted schedules, a tapered warm-up and
the zero-bubble paper's own heuristic; its memory limit counts M_B and M_W."""
import collections
import csv
import math
import os
import time

import pytest

from torchpp import _schedule
from torchpp import schedule as S

UNEVEN = dict(f=1.0, i=1.2, w=0.8, comm=0.1)
MIXES = [(1.0, 1.0, 1.0, 0.0), (1.0, 1.2, 0.8, 0.05), (1.0, 1.2, 0.8, 0.1), (1.0, 1.5, 0.5, 0.0),
         (1.0, 1.1, 0.9, 0.25)]
PAPER = os.path.join(os.path.dirname(__file__), "reference", "zb_paper_heuristic.csv")
TIE = 1e-9


def max_span(sim):
    return max(e - s for s, e in zip(sim.span_start, sim.span_end))


def tapered(p, m, limit, taper, activation=1.0, weight_pending=0.5):
    """1F1B's order with I/W split, rank r holding at most floor(limit / M_B) - taper * r
    activations, each W deferred until memory forces it (a ZB-H1 that fills the limit)."""
    most = math.floor(limit / activation + TIE)
    rows = []
    for r in range(p):
        out, pending, count = [], collections.deque(), dict(f=0, i=0, memory=0.0)

        def forward():
            while count["memory"] + activation > limit + TIE and pending:
                out.append(f"{r}W{pending.popleft()}")
                count["memory"] -= weight_pending
            out.append(f"{r}F{count['f']}")
            count["f"] += 1
            count["memory"] += activation

        def backward():
            out.append(f"{r}I{count['i']}")
            pending.append(count["i"])
            count["i"] += 1
            count["memory"] += weight_pending - activation

        for _ in range(min(m, max(1, most - taper * r))):
            forward()
        while count["f"] < m:
            backward()
            forward()
        while count["i"] < m:
            backward()
        out += [f"{r}W{k}" for k in pending]
        rows.append(",".join(out))
    return S.Schedule(_schedule.from_csv("\n".join(rows) + "\n", p, m, 1))


@pytest.mark.parametrize("p,m", [(2, 2), (2, 8), (4, 4), (4, 8), (4, 12), (8, 8), (8, 24), (16, 48)])
@pytest.mark.parametrize("costs", [dict(f=1.0, i=1.0, w=1.0, comm=0.0), UNEVEN])
def test_memory_p_never_worse_than_zb_h1(p, m, costs):
    auto = S.generate("zb-auto", p, m, costs=costs, memory_limit=p)
    auto_sim, h1_sim = S.simulate(auto, **costs), S.simulate(S.generate("zb-h1", p, m), **costs)
    assert max(auto_sim.peak_memory) <= p
    assert auto_sim.makespan <= h1_sim.makespan + TIE
    assert auto_sim.bubble_ratio <= h1_sim.bubble_ratio + TIE


@pytest.mark.parametrize("p,m", [(2, 6), (4, 12), (4, 20), (8, 24), (8, 32), (16, 48)])
def test_memory_2p_bubble_under_one_percent(p, m):
    sim = S.simulate(S.generate("zb-auto", p, m, memory_limit=2 * p))
    assert max(sim.peak_memory) <= 2 * p
    assert sim.bubble_ratio < 0.01


@pytest.mark.parametrize("p,m", [(4, 12), (8, 24)])
def test_uneven_costs_reported_and_better_than_1f1b(p, m):
    """F=1, I=1.2, W=0.8, comm=0.1: the searched schedule beats 1F1B and ZB-H1."""
    sims = {name: S.simulate(S.generate(name, p, m, costs=UNEVEN, memory_limit=2 * p if name == "zb-auto" else None),
                             **UNEVEN)
            for name in ["1f1b", "zb-h1", "zb-auto"]}
    print({name: round(sim.bubble_ratio, 4) for name, sim in sims.items()})
    assert sims["zb-auto"].bubble_ratio < sims["zb-h1"].bubble_ratio < sims["1f1b"].bubble_ratio
    assert max(sims["zb-auto"].peak_memory) <= 2 * p


@pytest.mark.parametrize("f,i,w,comm", MIXES)
def test_cost_sweep_never_worse_than_seeds_or_a_tapered_warm_up(f, i, w, comm):
    """Over p, m and the limit: peak memory (M_B and M_W weighted) within the limit, and the
    makespan no worse than ZB-H1 / ZB-H2 (where they fit) or a tapered warm-up; with
    objective="span", the same for the longest span."""
    costs = (f, i, w, comm)
    checked = 0
    for p in (2, 3, 4, 6, 8):
        for m in sorted({p, p + 1, 2 * p, 3 * p}):
            for limit in sorted({max(1.0, p / 2), float(p), 1.5 * p, 2.0 * p}):
                peers = [tapered(p, m, limit, taper) for taper in (1, 2)]
                peers += [S.generate(name, p, m) for name in ("zb-h1", "zb-h2")]
                peer_sims = [S.simulate(peer, *costs) for peer in peers]
                fitting = [sim for sim in peer_sims if max(sim.peak_memory) <= limit + TIE]
                assert len(fitting) >= 2  # the tapered warm-ups always fit
                for objective, measure in (("makespan", lambda s: s.makespan), ("span", max_span)):
                    sim = S.simulate(S.generate("zb-auto", p, m, costs=costs, memory_limit=limit,
                                                objective=objective), *costs)
                    where = f"p={p} m={m} limit={limit} objective={objective}"
                    assert max(sim.peak_memory) <= limit + TIE, where
                    assert measure(sim) <= min(measure(peer) for peer in fitting) + TIE, where
                    checked += 1
    assert checked == 5 * 4 * 4 * 2


def test_never_worse_than_the_paper_heuristic():
    """tests/schedule/reference/zb_paper_heuristic.csv: the span and makespan of the schedule
    the zero-bubble paper's own scheduler (sail-sg/zero-bubble-pipeline-parallelism,
    Graph.manual_order, its 8 settings) picks on 150 settings, simulated by torchpp; written
    by bench/bench_zb_auto.py --golden. zb-auto's makespan is never longer; with
    objective="span", its span is never longer."""
    with open(PAPER) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 150
    for row in rows:
        p, m, limit = int(row["p"]), int(row["m"]), float(row["memory_limit"])
        costs = dict(f=float(row["f"]), i=float(row["i"]), w=float(row["w"]), comm=float(row["comm"]),
                     weight_pending=float(row["weight_pending"]))
        for objective, key in (("makespan", "makespan"), ("span", "span")):
            sim = S.simulate(S.generate("zb-auto", p, m, costs=costs, memory_limit=limit, objective=objective),
                             **costs)
            where = f"{row} objective={objective}"
            assert max(sim.peak_memory) <= limit + TIE, where
            ours = sim.makespan if key == "makespan" else max_span(sim)
            assert ours <= float(row[key]) + TIE, where


ISSUE_COSTS = dict(f=1.0, i=1.2, w=0.8, comm=0.05)


def test_issue_27_limit_counts_pending_weight_gradients():
    """p=16, m=48, limit 32 gave 32 activations plus 48 pending W's (40 M_B at M_W = M_B/2)."""
    sim = S.simulate(S.generate("zb-auto", 16, 48, costs=ISSUE_COSTS, memory_limit=32), **ISSUE_COSTS)
    assert max(sim.peak_memory) <= 32
    h2 = S.simulate(S.generate("zb-h2", 16, 48), **ISSUE_COSTS)  # fits: 31 M_B on rank 0
    assert sim.makespan <= h2.makespan + TIE


def test_issue_27_never_slower_than_its_seed():
    """p=16, m=48, limit 16: zb-auto took 171.45 against ZB-H1's 168.00."""
    auto = S.simulate(S.generate("zb-auto", 16, 48, costs=ISSUE_COSTS, memory_limit=16), **ISSUE_COSTS)
    h1 = S.simulate(S.generate("zb-h1", 16, 48), **ISSUE_COSTS)
    assert max(auto.peak_memory) <= 16
    assert h1.makespan == pytest.approx(168.0)
    assert auto.makespan <= h1.makespan + TIE


def test_issue_27_small_case_tapers_like_1f1b():
    """p=4, m=8, limit 4: the paper's scheduler tapers its warm-up (4, 3, 2, 1 activations);
    zb-auto filled every rank (4, 4, 4, 1) and was slower. Now it is as tapered and faster."""
    auto = S.simulate(S.generate("zb-auto", 4, 8, costs=ISSUE_COSTS, memory_limit=4), **ISSUE_COSTS)
    assert auto.peak_activations == [4, 3, 2, 1]
    with open(PAPER) as f:
        paper = next(r for r in csv.DictReader(f) if (r["p"], r["m"], r["memory_limit"], r["comm"]) == ("4", "8", "4", "0.05"))
    assert auto.makespan < float(paper["makespan"])


@pytest.mark.parametrize("activation,weight_pending", [(1.0, 0.0), (1.0, 0.25), (1.0, 1.0), (1.0, 1.5), (2.0, 1.0)])
@pytest.mark.parametrize("name", ["zb-auto", "zb-v"])
def test_memory_units(name, activation, weight_pending):
    """The limit is in the unit of M_B and M_W, whatever their ratio (M_W above M_B included)."""
    units = dict(activation=activation, weight_pending=weight_pending)
    for p, m in [(2, 4), (4, 8), (4, 12), (8, 16)]:
        # zb-v's V needs room on rank 0 for its first stage's warm-up and its last stage.
        tight = 2 * p * activation if name == "zb-v" else max(activation, weight_pending)
        for limit in (tight, tight + weight_pending, 2 * p * activation, 3 * p * activation):
            sch = S.generate(name, p, m, costs=dict(UNEVEN, **units), memory_limit=limit)
            sch.validate()
            sim = S.simulate(sch, **UNEVEN, **units)
            assert max(sim.peak_memory) <= limit + TIE, (p, m, limit)


def test_default_limit_counts_weight_gradients():
    """Default limit p M_B, default M_W = M_B / 2: the simulator's default units measure it."""
    for p, m in [(4, 12), (8, 24)]:
        sim = S.simulate(S.generate("zb-auto", p, m, costs=UNEVEN), **UNEVEN)
        assert max(sim.peak_memory) <= p
        assert max(sim.peak_weight_pending) > 0


def test_generation_is_fast():
    for limit in (16, 32):
        start = time.perf_counter()
        S.generate("zb-auto", 16, 48, costs=ISSUE_COSTS, memory_limit=limit)
        assert time.perf_counter() - start < 2.0


def test_memory_limit_is_respected_below_p():
    sim = S.simulate(S.generate("zb-auto", 8, 16, memory_limit=3))
    assert max(sim.peak_memory) <= 3


def test_memory_limit_below_one_activation_is_refused():
    with pytest.raises(ValueError, match=r"memory_limit >= max\(M_B, M_W\) = 1 .*memory_limit=0.5"):
        S.generate("zb-auto", 4, 8, memory_limit=0.5)
    with pytest.raises(ValueError, match=r"memory_limit >= max\(M_B, M_W\) = 2 .*memory_limit=1.5"):
        S.generate("zb-auto", 4, 8, costs=dict(activation=2.0), memory_limit=1.5)
    with pytest.raises(ValueError, match=r"memory_limit >= max\(M_B, M_W\) = 1.5 "):
        S.generate("zb-auto", 4, 8, costs=dict(weight_pending=1.5), memory_limit=1.2)


def test_bad_objective_and_units_are_refused():
    with pytest.raises(ValueError, match='objective "makespan" or "span".*objective="fastest"'):
        S.generate("zb-auto", 4, 8, objective="fastest")
    with pytest.raises(ValueError, match="M_B > 0 and M_W >= 0.*M_W=-1"):
        S.generate("zb-auto", 4, 8, costs=dict(weight_pending=-1.0))


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 12), (8, 16), (8, 24)])
def test_zb_v_default_limit_with_transfer_latency(p, m):
    """With comm > 0 every setting used to fill rank r with stage r's activations and wait
    for stage 2p-1-r: zb-v refused its own default limit (2p M_B)."""
    sch = S.generate("zb-v", p, m, costs=UNEVEN)
    sch.validate()
    sim = S.simulate(sch, **UNEVEN)
    assert max(sim.peak_memory) <= 2 * p


def _stage_costs(rng, stages):
    """Random per-stage F, I, W with the heavier ends of a real model (embedding, head and loss)."""
    f = [rng.uniform(0.6, 1.6) for _ in range(stages)]
    i = [x * rng.uniform(0.9, 1.5) for x in f]
    w = [x * rng.uniform(0.4, 1.1) for x in f]
    f[0] *= rng.uniform(1.0, 1.5)
    for costs in (f, i, w):
        costs[-1] *= rng.uniform(1.0, 2.5)
    return f, i, w


@pytest.mark.parametrize("name", ["zb-auto", "zb-v"])
def test_per_stage_costs_never_longer_than_their_median(name):
    """Over random per-stage costs: the schedule built from them, simulated on them, is never
    longer than the one built from each pass's median cost."""
    import random
    import statistics

    rng = random.Random(36)
    longer_by_median = 0
    for _ in range(40):
        p = rng.choice((2, 3, 4, 6))
        m = rng.choice((p, 2 * p, 3 * p))
        stages = p if name == "zb-auto" else 2 * p
        f, i, w = _stage_costs(rng, stages)
        comm = rng.choice((0.0, 0.05, 0.2))
        limit = rng.choice((None, 1.5 * stages))
        median = dict(f=statistics.median(f), i=statistics.median(i), w=statistics.median(w), comm=comm)
        ours = S.generate(name, p, m, costs=dict(f=f, i=i, w=w, comm=comm), memory_limit=limit)
        theirs = S.generate(name, p, m, costs=median, memory_limit=limit)
        a, b = (S.simulate(s, f=f, i=i, w=w, comm=comm) for s in (ours, theirs))
        assert a.makespan <= b.makespan + TIE, (p, m, f, i, w, comm, limit)
        assert max(a.peak_memory) <= (limit or (p if name == "zb-auto" else 2 * p)) + TIE
        longer_by_median += a.makespan < b.makespan - TIE
    assert longer_by_median > 0  # the per-stage costs do change some schedules


def test_per_stage_costs_need_one_value_per_stage():
    with pytest.raises(ValueError, match=r"one f cost per stage \(4 stages\).*3 f costs"):
        S.generate("zb-auto", 4, 8, costs=dict(f=[1.0, 1.0, 1.0]))
    with pytest.raises(ValueError, match=r"one w cost per stage \(8 stages\).*4 w costs"):
        S.generate("zb-v", 4, 8, costs=dict(w=[1.0] * 4))
    with pytest.raises(ValueError, match="cost 'comm' takes one number"):
        S.generate("zb-auto", 4, 8, costs=dict(comm=[0.1] * 4))
