"""Simulator details, Chrome trace, timeline plot and the CLI."""
import json
import os
import subprocess
import sys

import pytest

from torchpp import schedule as S

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_comm_latency_delays_each_cross_rank_hop():
    sch = S.generate("1f1b", 4, 1)  # one microbatch: 3 hops forward, 3 back
    assert S.simulate(sch, comm=0.5).makespan == S.simulate(sch).makespan + 6 * 0.5


def test_per_stage_costs_and_memory_units():
    sch = S.generate("zb-h1", 2, 4)
    sim = S.simulate(sch, f=[1.0, 2.0], i=[1.0, 2.0], w=[1.0, 1.0], activation=10.0, weight_pending=3.0)
    assert sim.busy == [4 * 3.0, 4 * 5.0]
    for r in range(2):  # replay the action list: M_B from F until I, M_W from I until W
        held_b = held_w = peak = 0.0
        for action in sch.actions(r):
            kind = action[1]
            held_b += {"F": 1, "I": -1}.get(kind, 0)
            held_w += {"I": 1, "W": -1}.get(kind, 0)
            peak = max(peak, 10.0 * held_b + 3.0 * held_w)
        assert sim.peak_memory[r] == peak
    assert sim.peak_memory[1] == 13.0  # rank 1 defers one W: 1F1 runs while 1W0 is pending


def test_timeline_is_sequential_and_respects_dependencies():
    sim = S.simulate(S.generate("interleaved-1f1b", 4, 8, num_chunks=2), comm=0.25)
    ends = {}
    for line in sim.timeline:
        for (_, _, _, _, start, end), nxt in zip(line, line[1:]):
            assert end <= nxt[4]
        for action, kind, stage, mb, start, end in line:
            ends[(kind, stage, mb)] = (start, end)
    for src, dst, producer, consumer, sent, arrived in sim.transfers:
        assert arrived == sent + 0.25
        kind = consumer.lstrip("0123456789")[0]
        stage = int(consumer[: consumer.index(kind)])
        assert ends[(kind, stage, int(consumer[consumer.index(kind) + 1:]))][0] >= arrived


def test_chrome_trace(tmp_path):
    sch = S.generate("zb-v", 4, 8)
    sim = S.simulate(sch, comm=0.1)
    path = str(tmp_path / "trace.json")
    sim.to_chrome_trace(path)
    events = json.load(open(path))["traceEvents"]
    compute = [e for e in events if e.get("ph") == "X" and e["tid"] == 0]
    comm = [e for e in events if e.get("ph") == "X" and e["tid"] == 1]
    assert len(compute) == sum(len(sch.actions(r)) for r in range(4))
    assert {e["pid"] for e in compute} == set(range(4))
    starts = [e for e in events if e.get("ph") == "s"]
    finishes = [e for e in events if e.get("ph") == "f"]
    assert len(starts) == len(finishes) == len(sim.transfers) == len(comm) // 2
    assert sorted(e["id"] for e in starts) == sorted(e["id"] for e in finishes)


def test_plot_writes_png(tmp_path):
    path = str(tmp_path / "t.png")
    S.simulate(S.generate("dualpipe", 4, 8)).plot(path)
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_cli(tmp_path):
    out = {k: str(tmp_path / f"o.{k}") for k in ("csv", "json", "png")}
    result = subprocess.run(
        [sys.executable, "-m", "torchpp.schedule", "--schedule", "zb-h1", "--pp", "4", "--microbatches", "8",
         "--costs", "1,1,1,0", "--csv", out["csv"], "--trace", out["json"], "--plot", out["png"]],
        capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "rank 3 | 3F0 3I0" in result.stdout
    assert "bubble ratio 0.1111" in result.stdout
    assert "peak activations per rank (M_B): 4 3 2 1" in result.stdout
    assert all(os.path.getsize(path) > 0 for path in out.values())
    assert S.from_csv(out["csv"], num_ranks=4, num_microbatches=8).actions(0)[:5] == \
        ["0F0", "0F1", "0F2", "0F3", "0I0"]


def test_cli_reports_constraint_errors():
    result = subprocess.run(
        [sys.executable, "-m", "torchpp.schedule", "--schedule", "dualpipe", "--pp", "3", "--microbatches", "12"],
        capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, timeout=120)
    assert result.returncode == 2 and "even number of ranks" in result.stderr
