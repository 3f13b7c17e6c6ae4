"""The Schedule object and the functions that make one (generators and CSV import)."""
from __future__ import annotations

from typing import List, NamedTuple, Sequence, Union

from torchpp import _schedule

ScheduleError = _schedule.ScheduleError
SCHEDULES: tuple[str, ...] = tuple(_schedule.schedule_names())


PerStage = Union[float, Sequence[float]]


class Costs(NamedTuple):
    """Per-microbatch pass costs (any time unit; B costs ``i + w``) and memory.

    ``f``, ``i`` and ``w`` are each one number for every stage or a sequence with one value per
    stage (a heavier first stage with the embedding, a last stage with the head and loss):
    zb-auto and the V family schedule on them, and ``simulate`` takes the same sequences.

    Args:
        f: forward.
        i: backward for inputs (the zero-bubble paper's "B").
        w: backward for weights.
        comm: latency of one transfer between stages on different ranks.
        activation: memory a microbatch-stage holds from its F to its I (M_B).
        weight_pending: memory it holds from its I to its W (M_W); the default M_B / 2 is the
            zero-bubble paper scheduler's estimate. zb-auto and zb-v's ``memory_limit`` counts both.
    """

    f: PerStage = 1.0
    i: PerStage = 1.0
    w: PerStage = 1.0
    comm: float = 0.0
    activation: float = 1.0
    weight_pending: float = 0.5


CostsLike = Union[Costs, Sequence[float], dict, None]


def _number_or_per_stage(name: str, value) -> PerStage:
    if isinstance(value, (int, float)):
        return float(value)
    if name not in ("f", "i", "w"):
        raise ValueError(f"cost {name!r} takes one number, got {value!r}")
    return tuple(float(v) for v in value)


def as_costs(costs: CostsLike) -> Costs:
    """Reads ``Costs``, ``(F, I, W[, comm])`` or a dict of ``Costs`` fields; None gives the
    defaults. F, I and W may each be a sequence, one value per stage."""
    if costs is None:
        return Costs()
    if isinstance(costs, dict):
        unknown = set(costs) - set(Costs._fields)
        if unknown:
            raise ValueError(f"unknown cost keys {sorted(unknown)}; expected {Costs._fields}")
        return Costs(**{k: _number_or_per_stage(k, v) for k, v in costs.items()})
    if not isinstance(costs, Costs) and len(costs) not in (3, 4):
        raise ValueError(f"costs take (F, I, W) or (F, I, W, comm), got {len(costs)} values: {list(costs)}")
    return Costs(*(_number_or_per_stage(k, v) for k, v in zip(Costs._fields, costs)))


def split_per_stage(value: PerStage) -> tuple[float, list[float]]:
    """(a scalar, the per-stage list or []) as the compiler takes a cost."""
    if isinstance(value, (int, float)):
        return float(value), []
    values = [float(v) for v in value]
    return (values[0] if values else 0.0), values


class Schedule:
    """Per-rank ordered actions of a pipeline schedule, plus its stage placement.

    Stage ``s`` runs on rank ``stage_to_rank[s]``. DualPipe has two pipelines
    (``num_pipelines == 2``): stages ``0..p-1`` carry microbatches ``[0, m/2)`` from rank 0
    to rank p-1 and stages ``p..2p-1`` carry ``[m/2, m)`` back; stage ``p+k`` duplicates the
    parameters of stage ``k`` (``model_stage``). See csrc/schedule/ir.h.
    """

    def __init__(self, native: _schedule.Schedule):
        self._native = native

    name = property(lambda self: self._native.name)
    num_ranks = property(lambda self: self._native.num_ranks)
    num_stages = property(lambda self: self._native.num_stages)
    num_microbatches = property(lambda self: self._native.num_microbatches)
    num_pipelines = property(lambda self: self._native.num_pipelines)
    stage_to_rank = property(lambda self: list(self._native.stage_to_rank))
    is_lowered = property(lambda self: self._native.is_lowered)

    def actions(self, rank: int) -> list[str]:
        """Action strings of ``rank`` in execution order ("0F3", "1SEND_F3", ...).

        Args:
            rank: pipeline rank in ``[0, num_ranks)``.
        """
        return self._native.actions(rank)

    def lowered(self, in_order: bool = False) -> "Schedule":
        """This schedule with SEND/RECV actions at every cross-rank stage boundary.

        Args:
            in_order: lower for a transport that matches messages by order and may hold a send
                until its receive is posted (NCCL): both ranks of a pair issue their messages in
                one global order, which ``check_in_order_p2p`` proves deadlock-free. The default
                lowering posts each receive just before its consumer, which suits tagged,
                non-blocking transports (gloo).
        """
        return Schedule(self._native.lowered(in_order))

    def check_in_order_p2p(self) -> None:
        """Raises ScheduleError if this lowered schedule can deadlock on an in-order, blocking
        transport: every rank issues its actions in order, messages share one communication
        stream per rank, and a message moves only while both ranks have it at the front."""
        self._native.check_in_order_p2p()

    def compute_only(self) -> "Schedule":
        """This schedule without its SEND/RECV actions."""
        return Schedule(self._native.compute_only())

    def forward_only(self) -> "Schedule":
        """The forward passes alone, each rank's in this schedule's order: an evaluation step
        (no backward, so nothing waits on one). Lower it like any schedule."""
        return Schedule(self._native.forward_only())

    def model_stage(self, stage: int) -> int:
        """The stage whose parameters ``stage`` holds (differs only for DualPipe's pipeline 1)."""
        return self._native.model_stage(stage)

    def loss_microbatches(self, rank: int) -> List[int]:
        """The microbatches whose loss ``rank`` computes (on its last stages), in order: all of
        them on the last rank; under DualPipe, each end rank has the half its pipeline carries."""
        native, per_pipeline = self._native, self.num_stages // self.num_pipelines
        return sorted(k for stage, r in enumerate(self.stage_to_rank)
                      if r == rank and stage % per_pipeline == per_pipeline - 1
                      for k in native.microbatches_of_pipeline(native.pipeline_of_stage(stage)))

    def validate(self) -> None:
        """Raises ScheduleError (with the rank x step grid, offending step marked) if invalid."""
        self._native.validate()

    def grid(self, max_steps: int = 0) -> str:
        """ASCII grid, one row per rank, one column per step.

        Args:
            max_steps: cut the grid after this many steps; 0 shows all.
        """
        return self._native.grid(max_steps)

    def to_csv(self, path: str) -> None:
        """Writes torch.distributed.pipelining's CSV: one row per rank, one action per cell.

        Args:
            path: file to write.
        """
        with open(path, "w", newline="") as f:
            f.write(self._native.to_csv())

    def __repr__(self) -> str:
        kind = "lowered " if self.is_lowered else ""
        return (f"Schedule({self.name!r}, {kind}num_ranks={self.num_ranks}, num_stages={self.num_stages}, "
                f"num_microbatches={self.num_microbatches})")


def generate(
    name: str,
    num_ranks: int,
    num_microbatches: int,
    num_chunks: int | None = None,
    costs: CostsLike = None,
    memory_limit: float | None = None,
    microbatch_group_size: int | None = None,
    objective: str = "makespan",
) -> Schedule:
    """Builds schedule ``name`` (one of ``SCHEDULES``).

    Args:
        name: gpipe, 1f1b, eager-1f1b, interleaved-1f1b, looped-bfs, zb-h1, zb-h2, zb-auto,
            interleaved-zb, zb-v, v-half, v-min, dualpipe or dualpipe-v.
        num_ranks: pipeline ranks p.
        num_microbatches: microbatches per step m.
        num_chunks: stages per rank v (interleaved-1f1b and looped-bfs, default 2; schedules
            with a fixed count accept only that count).
        costs: ``Costs``, ``(F, I, W[, comm])`` or a dict, F, I and W each a number or one
            value per stage; used by zb-auto and the V family (zb-v, v-half, v-min). Given
            per-stage costs, the search also tries the schedules their per-pass medians give,
            so the result is never longer (on the real costs) than the median's.
        memory_limit: zb-auto and the V family: most memory a rank may hold, in the unit of
            the costs' ``activation`` (M_B, default 1) and ``weight_pending`` (M_W, default
            0.5): M_B per microbatch-stage between F and I plus M_W per one between I and W.
            Default p M_B for zb-auto and 2p M_B for zb-v; v-half and v-min without a limit
            are the paper's building blocks, with one they search as zb-v does (the least
            limit that works is V-Min's peak).
        microbatch_group_size: interleaved-1f1b: microbatches per depth-first group; must
            divide m and be >= min(p, m); default p, or the next divisor of m above p.
        objective: zb-auto / zb-v: what the search minimizes first, ``"makespan"`` (one step
            ending in an optimizer barrier) or ``"span"`` (the longest rank span, the paper's
            objective: steps run back to back, e.g. with post-validation); the other breaks ties.

    Raises:
        ValueError: the schedule cannot serve (p, m, v); the message names the constraint.
    """
    c = as_costs(costs)
    (f, stage_f), (i, stage_i), (w, stage_w) = (split_per_stage(v) for v in (c.f, c.i, c.w))
    return Schedule(_schedule.generate(
        name, num_ranks, num_microbatches, num_chunks or 0, f, i, w, c.comm,
        memory_limit or 0.0, microbatch_group_size or 0, c.activation, c.weight_pending, objective,
        stage_f, stage_i, stage_w))


def from_csv(path: str, num_ranks: int, num_microbatches: int, num_pipelines: int | None = None) -> Schedule:
    """Reads and validates a schedule in torch.distributed.pipelining's CSV format.

    Args:
        path: CSV file, one row per rank (compute-only or with SEND/RECV).
        num_ranks: pipeline ranks p.
        num_microbatches: microbatches m.
        num_pipelines: 2 for DualPipe; None infers it from which microbatches stage 0 runs.
    """
    with open(path, newline="") as f:
        text = f.read()
    schedule = Schedule(_schedule.from_csv(text, num_ranks, num_microbatches, num_pipelines or 0))
    schedule.validate()
    return schedule
