"""Real-run timelines: every rank's measured actions merged into one Chrome trace (the
simulator's trace format, written by the same C++ writer) and a timeline picture."""
from __future__ import annotations

import re
import statistics
from types import SimpleNamespace
from typing import Dict, List, Optional

import torch.distributed as dist

from torchpp import _C
from torchpp.parallel.object_collectives import all_gather_objects

_ACTION = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|I|W|B)(\d+)$")
COMPUTE = ("F", "I", "W", "B")


def parse_action(text: str):
    """(stage, type, microbatch) of an action string such as "1SEND_F3"."""
    match = _ACTION.match(text)
    if match is None:
        raise ValueError(f"not an action string: {text!r}")
    return int(match.group(1)), match.group(2), int(match.group(3))


def gather_runs(sched, group=None) -> List[dict]:
    """Collective over ``group`` (default: all ranks): every rank's last-step timeline and
    placement, in global-rank order."""
    mine = {
        "rank": dist.get_rank(),
        "pp_rank": sched.rank,
        "pp_ranks": dist.get_process_group_ranks(sched.group),
        "stage_to_rank": sched.schedule.stage_to_rank,
        "timeline": sched.timeline(),
        "peak_activations": sched.peak_activations,
    }
    return sorted(all_gather_objects(mine, group), key=lambda run: run["rank"])


def _origin(runs: List[dict]) -> float:
    return min(rec[1] for run in runs for rec in run["timeline"])


def measured_transfers(runs: List[dict], origin: float) -> list:
    """(src, dst, producer, consumer, send_us, arrive_us) for every SEND in the runs."""
    by_rank = {run["rank"]: run for run in runs}
    transfers = []
    for run in runs:
        for action, start, _end, _arrived in run["timeline"]:
            stage, kind, mb = parse_action(action)
            if kind not in ("SEND_F", "SEND_B"):
                continue
            forward = kind == "SEND_F"
            consumer_stage = stage + 1 if forward else stage - 1
            dst = run["pp_ranks"][run["stage_to_rank"][consumer_stage]]
            recv = f"{consumer_stage}{'RECV_F' if forward else 'RECV_B'}{mb}"
            arrived = next((a for name, _s, _e, a in by_rank[dst]["timeline"] if name == recv and a >= 0), start)
            producer = f"{stage}{'F' if forward else 'I'}{mb}"
            consumer = f"{consumer_stage}{'F' if forward else 'I'}{mb}"
            transfers.append((run["rank"], dst, producer, consumer, start - origin, max(arrived, start) - origin))
    return transfers


def chrome_trace_json(runs: List[dict]) -> str:
    """The Chrome trace of gathered runs: one process per global rank, times in microseconds."""
    origin = _origin(runs)
    compute = [
        [(a, s - origin, e - origin) for a, s, e, _ in run["timeline"] if parse_action(a)[1] in COMPUTE]
        for run in runs
    ]
    return _C.real_run_chrome_trace(len(runs), compute, measured_transfers(runs, origin))


def export_chrome_trace(sched, path: str, group=None) -> Optional[str]:
    """Writes the last step of every rank into one Chrome-trace file (on global rank 0).

    Collective over ``group`` (default: all ranks). Returns the path on the writing rank.

    Args:
        sched: the PipelineSchedule that ran the step.
        path: JSON file to write.
        group: ranks to merge; all of them by default.
    """
    runs = gather_runs(sched, group)
    if dist.get_rank() != runs[0]["rank"]:
        return None
    with open(path, "w") as f:
        f.write(chrome_trace_json(runs))
    return path


def measured_simulation(sched, runs: List[dict]) -> SimpleNamespace:
    """The pipeline group of the first rank as a Simulation-like object (times in ms): what
    ``torchpp.schedule``'s timeline plot draws, plus the measured bubble ratio."""
    pp_ranks = runs[0]["pp_ranks"]
    by_rank = {run["rank"]: run for run in runs}
    group_runs = [by_rank[g] for g in pp_ranks]
    origin = _origin(group_runs)
    timeline = []
    for run in group_runs:
        line = []
        for action, start, end, _ in run["timeline"]:
            stage, kind, mb = parse_action(action)
            if kind in COMPUTE:
                line.append((action, kind, stage, mb, (start - origin) / 1e3, (end - origin) / 1e3))
        timeline.append(line)
    busy = [sum(e - s for *_, s, e in line) for line in timeline]
    spans = [line[-1][5] - line[0][4] for line in timeline]
    makespan = max(line[-1][5] for line in timeline)
    bubble_ratio = (max(spans) - max(busy)) / max(spans)
    return SimpleNamespace(
        schedule=sched.schedule, makespan=makespan, timeline=timeline, busy=busy,
        bubble_ratio=bubble_ratio, peak_activations=[run["peak_activations"] for run in group_runs],
    )


def measured_costs(sim: SimpleNamespace) -> Dict[str, List[float]]:
    """Each stage's median F, I and W time (ms) in a measured run (``measured_simulation``), as
    ``simulate``'s per-stage ``f``, ``i``, ``w``. A stage whose backward ran fused (B) only
    gets I = B, W = 0 (the simulator's B costs I + W). The last stage's F includes the loss."""
    spans: Dict[tuple, List[float]] = {}
    for line in sim.timeline:
        for _action, kind, stage, _mb, start, end in line:
            spans.setdefault((kind, stage), []).append(end - start)

    def median(kind, stage):
        return statistics.median(spans[kind, stage]) if (kind, stage) in spans else 0.0

    costs = {"f": [], "i": [], "w": []}
    for stage in range(sim.schedule.num_stages):
        split = (("I", stage) in spans) or (("W", stage) in spans)
        costs["f"].append(median("F", stage))
        costs["i"].append(median("I", stage) if split else median("B", stage))
        costs["w"].append(median("W", stage) if split else 0.0)
    return costs


def predicted_simulation(sim: SimpleNamespace):
    """The simulator's run of the measured schedule from its measured per-stage costs
    (``measured_costs``; no transfer latency): what the schedule should give with these
    costs, to set against the measured bubble."""
    from torchpp import schedule as S

    return S.simulate(sim.schedule, **measured_costs(sim))


def plot_timeline(sched, path: str, group=None, title: Optional[str] = None) -> Optional[str]:
    """Draws the last step of the first pipeline group (ranks as rows, time in ms) on global
    rank 0, with the schedule compiler's timeline plot. Collective over ``group``.

    Args:
        sched: the PipelineSchedule that ran the step.
        path: image file to write.
        group: ranks to gather from; all of them by default.
        title: figure title; defaults to the schedule and its measured bubble ratio.
    """
    runs = gather_runs(sched, group)
    if dist.get_rank() != runs[0]["rank"]:
        return None
    from torchpp.schedule.plot import plot_timeline as draw

    sim = measured_simulation(sched, runs)
    sch = sched.schedule
    title = title or (f"{sch.name} real run  p={sch.num_ranks} m={sch.num_microbatches}  time in ms  "
                      f"measured bubble ratio {sim.bubble_ratio:.3f}")
    draw(sim, path, title, unit="ms")
    return path
