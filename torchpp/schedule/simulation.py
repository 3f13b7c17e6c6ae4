"""Simulated timing of a schedule: makespan, bubble, memory, Chrome trace and timeline plot."""
from __future__ import annotations

from torchpp import _schedule
from torchpp.schedule.schedule import PerStage, Schedule, split_per_stage


class Simulation:
    """Result of ``simulate``; times are in the unit of the costs.

    Attributes:
        makespan: end of the last action of one iteration (includes the start-up skew).
        bubble_ratio: (max span - work) / max span, a rank's span running from the start of
            its first action to the end of its last and work being the busiest rank's compute.
        peak_activations: per rank, most microbatch-stages held between F and I (or B), in
            units of M_B.
        peak_weight_pending: per rank, most microbatch-stages held between I and W (M_W).
        peak_memory: per rank, peak of ``activation * held_B + weight_pending * held_W``.
        busy, idle, span_start, span_end: per rank.
        timeline: per rank, ``(action, type, stage, microbatch, start, end)`` tuples.
        transfers: ``(src_rank, dst_rank, producer, consumer, send_time, arrive_time)``.
    """

    def __init__(self, schedule: Schedule, native: _schedule.Simulation):
        self.schedule = schedule
        self._native = native
        self.makespan: float = native.makespan
        self.bubble_ratio: float = native.bubble_ratio
        self.peak_activations: list[int] = list(native.peak_activations)
        self.peak_weight_pending: list[int] = list(native.peak_weight_pending)
        self.peak_memory: list[float] = list(native.peak_memory)
        self.busy: list[float] = list(native.busy)
        self.idle: list[float] = list(native.idle)
        self.span_start: list[float] = list(native.span_start)
        self.span_end: list[float] = list(native.span_end)

    @property
    def timeline(self) -> list[list[tuple]]:
        return self._native.timeline

    @property
    def transfers(self) -> list[tuple]:
        return self._native.transfers

    @property
    def bubble(self) -> float:
        """Bubble time: max span minus the busiest rank's work."""
        return max(e - s for s, e in zip(self.span_start, self.span_end)) - max(self.busy)

    def to_chrome_trace(self, path: str, microseconds_per_unit: float = 1000.0) -> None:
        """Writes Chrome Trace Event JSON (chrome://tracing, Perfetto).

        Args:
            path: file to write.
            microseconds_per_unit: trace microseconds per cost unit.
        """
        with open(path, "w") as f:
            f.write(_schedule.chrome_trace_json(self.schedule._native, self._native, microseconds_per_unit))

    def plot(self, path: str, title: str | None = None) -> None:
        """Saves the timeline (ranks as rows, colour per action type) as an image.

        Args:
            path: image file (PNG, SVG, ... by extension).
            title: figure title; defaults to the schedule, its size and its bubble.
        """
        from torchpp.schedule.plot import plot_timeline

        plot_timeline(self, path, title)

    def __repr__(self) -> str:
        return (f"Simulation(makespan={self.makespan:g}, bubble_ratio={self.bubble_ratio:.4f}, "
                f"peak_activations={self.peak_activations})")


def simulate(
    schedule: Schedule,
    f: PerStage = 1.0,
    i: PerStage = 1.0,
    w: PerStage = 1.0,
    comm: float = 0.0,
    activation: float = 1.0,
    weight_pending: float = 0.5,
) -> Simulation:
    """Times every action of ``schedule`` (event-driven, execution semantics of the runtime).

    Args:
        schedule: a generated, loaded or lowered schedule.
        f: forward cost, a number or one per stage.
        i: backward-for-inputs cost, a number or one per stage.
        w: backward-for-weights cost, a number or one per stage; B costs i + w.
        comm: latency of a transfer between stages on different ranks.
        activation: memory of one held activation (M_B), in bytes or any unit.
        weight_pending: memory held from I until W (M_W), same unit; default M_B / 2, as
            zb-auto's ``memory_limit`` counts it, so ``max(peak_memory)`` is what that limit bounds.

    Raises:
        ScheduleError: the schedule deadlocks (the message marks the blocked steps).
    """
    f0, fs = split_per_stage(f)
    i0, is_ = split_per_stage(i)
    w0, ws = split_per_stage(w)
    native = _schedule.simulate(schedule._native, f0, i0, w0, float(comm), fs, is_, ws,
                                float(activation), float(weight_pending))
    return Simulation(schedule, native)
