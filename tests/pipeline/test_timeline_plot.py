"""The demo's timeline picture and its simulator prediction (issue 27): a real run's axis in
ms (cost units only for a simulation), a readable height per rank, and the per-stage costs
read back from a timeline give the simulator's prediction for the same schedule."""
from __future__ import annotations

import struct

import matplotlib.figure
import pytest

from torchpp import schedule as S
from torchpp.pipeline.trace import measured_costs, predicted_simulation
from torchpp.schedule import plot

DPI = 110  # plot.py's savefig dpi


def _png_size(path):
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])  # IHDR: width, height


def _draw(monkeypatch, sim, path, **kwargs):
    """Draws ``sim`` and returns (x label, figure size in inches, png width and height)."""
    seen = {}
    save = matplotlib.figure.Figure.savefig

    def recording(fig, *args, **kw):
        seen["xlabel"] = fig.axes[0].get_xlabel()
        seen["inches"] = tuple(fig.get_size_inches())
        return save(fig, *args, **kw)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", recording)
    plot.plot_timeline(sim, path, **kwargs)
    return seen["xlabel"], seen["inches"], _png_size(path)


@pytest.mark.parametrize("name,p,m", [("1f1b", 2, 4), ("zb-h1", 4, 8), ("interleaved", 4, 8), ("1f1b", 8, 64)])
def test_timeline_axis_unit_and_height_per_rank(tmp_path, monkeypatch, name, p, m):
    sim = S.simulate(S.generate(name, p, m) if name != "interleaved" else S.generate("interleaved-1f1b", p, m, num_chunks=2))
    label, (width, height), (px_w, px_h) = _draw(monkeypatch, sim, str(tmp_path / "a.png"))
    assert label == "time (cost units)"
    label, _, _ = _draw(monkeypatch, sim, str(tmp_path / "b.png"), unit="ms")
    assert label == "time (ms)"  # a measured run (torchpp.pipeline.trace.plot_timeline passes unit="ms")
    assert height >= plot.ROW_INCHES * p and px_h >= 0.5 * DPI * p, (width, height, px_w, px_h)  # rows to read
    assert px_w / px_h <= 16, (px_w, px_h)  # not a thin strip (the demo's used to be 3960x253 px)


def _fake_runs(sch, sim, scale_us=1000.0):
    """What gather_runs returns for a real run that took ``sim``'s times in ms (one unit = 1 ms)."""
    return [dict(rank=r, pp_rank=r, pp_ranks=list(range(sch.num_ranks)), stage_to_rank=sch.stage_to_rank,
                 timeline=[(a, 5.0 + s * scale_us, 5.0 + e * scale_us, None) for a, _k, _st, _mb, s, e in line],
                 peak_activations=peak)
            for r, (line, peak) in enumerate(zip(sim.timeline, sim.peak_activations))]


def test_real_run_timeline_is_in_ms_and_predicted_from_its_costs(tmp_path, monkeypatch):
    """torchpp.pipeline.trace.plot_timeline (the demo's picture): measured times (µs) become ms
    on the axis; the prediction from the measured per-stage costs reproduces the run."""
    from torchpp.pipeline import trace

    sch = S.generate("zb-h1", 4, 8)
    sim = S.simulate(sch, f=[1.0, 1.5, 1.0, 2.0], i=1.25, w=0.5)
    runs = _fake_runs(sch, sim)
    monkeypatch.setattr(trace, "gather_runs", lambda sched, group=None: runs)
    monkeypatch.setattr(trace.dist, "get_rank", lambda: 0)
    sched = type("Sched", (), {"schedule": sch})()
    seen = {}
    save = matplotlib.figure.Figure.savefig

    def recording(fig, *args, **kw):
        seen["xlabel"], seen["xlim"] = fig.axes[0].get_xlabel(), fig.axes[0].get_xlim()
        return save(fig, *args, **kw)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", recording)
    path = str(tmp_path / "timeline.png")
    assert trace.plot_timeline(sched, path) == path
    assert seen["xlabel"] == "time (ms)" and seen["xlim"][1] == pytest.approx(sim.makespan)
    measured = trace.measured_simulation(sched, runs)
    assert measured_costs(measured) == dict(f=pytest.approx([1.0, 1.5, 1.0, 2.0]), i=pytest.approx([1.25] * 4),
                                            w=pytest.approx([0.5] * 4))
    assert predicted_simulation(measured).bubble_ratio == pytest.approx(measured.bubble_ratio)


@pytest.mark.parametrize("name,p,m,v", [("zb-h1", 4, 8, 1), ("1f1b", 3, 6, 1), ("interleaved", 2, 4, 2)])
def test_costs_read_back_from_a_timeline_predict_it(name, p, m, v):
    """A timeline with known per-stage costs (here the simulator's own, as a measured run would
    give them in ms): measured_costs reads them back (a fused B as I = B, W = 0) and the
    prediction from them has the same makespan and bubble."""
    sch = S.generate("interleaved-1f1b", p, m, num_chunks=v) if v > 1 else S.generate(name, p, m)
    stages = p * v
    f = [1.0 + 0.25 * s for s in range(stages)]
    i = [1.5 + 0.5 * (s % 2) for s in range(stages)]
    w = [0.75 + 0.125 * s for s in range(stages)]
    timed = S.simulate(sch, f=f, i=i, w=w)
    costs = measured_costs(timed)
    fused = not any(kind in ("I", "W") for line in timed.timeline for _, kind, *_ in line)
    assert costs["f"] == pytest.approx(f)
    if fused:  # 1F1B, interleaved: one B per microbatch, costing I + W
        assert costs["i"] == pytest.approx([a + b for a, b in zip(i, w)]) and costs["w"] == [0.0] * stages
    else:
        assert costs["i"] == pytest.approx(i) and costs["w"] == pytest.approx(w)
    predicted = predicted_simulation(timed)
    assert predicted.makespan == pytest.approx(timed.makespan)
    assert predicted.bubble_ratio == pytest.approx(timed.bubble_ratio)
