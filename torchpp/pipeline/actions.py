"""torch.distributed.pipelining's action vocabulary: computation types, the action tuple that
"0F3" parses into, per-rank action lists in its CSV format, and their validation.

Code written against torch's schedule IR (``_Action``, ``F``, ``SEND_B``, ...) migrates by
changing imports; torchpp's compiler (``torchpp.schedule``) reads and writes the same strings,
so an action list converts to a ``torchpp.schedule.Schedule`` (``to_schedule``) that the C++
executor runs.
"""
from __future__ import annotations

import csv
import enum
import re
from typing import Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple

from torchpp import _schedule


class ComputationType(str, enum.Enum):
    """What an action does; its value is the action string's type (torch's ``_ComputationType``)."""

    FORWARD = "F"
    BACKWARD_INPUT = "I"
    BACKWARD_WEIGHT = "W"
    UNSHARD = "UNSHARD"
    RESHARD = "RESHARD"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    FULL_BACKWARD = "B"
    OVERLAP_F_B = "OVERLAP_F_B"
    REDUCE_GRAD = "REDUCE_GRAD"

    @staticmethod
    def from_str(text: str) -> "ComputationType":
        """The type whose action-string form is ``text`` ("F", "SEND_B", ...)."""
        try:
            return ComputationType(text)
        except ValueError:
            known = [t.value for t in ComputationType]
            raise RuntimeError(f"unknown computation type {text!r}; expected one of {known}") from None

    def __str__(self) -> str:
        return self.value


FORWARD = ComputationType.FORWARD
BACKWARD_INPUT = ComputationType.BACKWARD_INPUT
BACKWARD_WEIGHT = ComputationType.BACKWARD_WEIGHT
FULL_BACKWARD = ComputationType.FULL_BACKWARD
UNSHARD = ComputationType.UNSHARD
RESHARD = ComputationType.RESHARD
SEND_F = ComputationType.SEND_F
RECV_F = ComputationType.RECV_F
SEND_B = ComputationType.SEND_B
RECV_B = ComputationType.RECV_B
OVERLAP_F_B = ComputationType.OVERLAP_F_B
REDUCE_GRAD = ComputationType.REDUCE_GRAD
# The short names of torch's "simple schedule format".
F, I, W, B = FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FULL_BACKWARD

COMPUTE_TYPES = (FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FULL_BACKWARD, OVERLAP_F_B)
# FSDP's gather/free of a stage's parameters and the gradient reduction: torchpp's executor has no
# use for them (its ZeRO stages and data parallelism work outside the pipeline step).
FSDP_TYPES = (UNSHARD, RESHARD, REDUCE_GRAD)
# Longest names first, so "SEND_F" is not read as "S..." and "REDUCE_GRAD" wins over shorter ones.
_TYPES_BY_LENGTH = "|".join(sorted((re.escape(t.value) for t in ComputationType if t is not OVERLAP_F_B),
                                   key=len, reverse=True))
_SINGLE = re.compile(rf"^(\d+)({_TYPES_BY_LENGTH})(\d*)$")
_GROUP = re.compile(r"^\((.*)\)([A-Z_]+)$")


class Action(NamedTuple):
    """One step of a rank: ``stage_index``, ``computation_type``, ``microbatch_index`` (None
    for per-stage actions such as UNSHARD), and ``sub_actions`` for a group such as
    OVERLAP_F_B ("(0F7;7B3)OVERLAP_F_B"). torch's ``_Action``: ``Action.from_str("0F3")``;
    ``repr`` gives the string back."""

    stage_index: int
    computation_type: ComputationType
    microbatch_index: Optional[int] = None
    sub_actions: Optional[Tuple["Action", ...]] = None

    def __repr__(self) -> str:
        if self.sub_actions is not None:
            return f"({';'.join(map(repr, self.sub_actions))}){self.computation_type.value}"
        mb = "" if self.microbatch_index is None else str(self.microbatch_index)
        return f"{self.stage_index}{self.computation_type.value}{mb}"

    __str__ = __repr__

    @property
    def is_compute_op(self) -> bool:
        return self.computation_type in COMPUTE_TYPES

    @staticmethod
    def from_str(text: str) -> Optional["Action"]:
        """The action ``text`` spells ("2F0", "1UNSHARD", "3SEND_F1", "(0F7;7B3)OVERLAP_F_B");
        None for an empty cell (an idle step)."""
        text = text.strip()
        if not text:
            return None
        group = _GROUP.match(text)
        if group is not None:
            subs = tuple(a for a in (Action.from_str(s) for s in group.group(1).split(";")) if a is not None)
            return Action(-1, ComputationType.from_str(group.group(2)), None, subs or None)
        single = _SINGLE.match(text)
        if single is None:
            raise RuntimeError(f"not an action string: {text!r}; expected <stage><type><microbatch>, e.g. 2F0, "
                               "1UNSHARD, 3SEND_F1")
        stage, kind, mb = single.groups()
        return Action(int(stage), ComputationType.from_str(kind), int(mb) if mb else None)


Order = Dict[int, List[Optional[Action]]]


def read_csv(path: str) -> Order:
    """Per rank (row), the actions of a CSV file in torch's format (empty cells are None)."""
    with open(path, newline="") as f:
        return {rank: [Action.from_str(cell) for cell in row] for rank, row in enumerate(csv.reader(f))}


def write_csv(order: Order, path: str) -> None:
    """Writes per-rank actions as torch's CSV: one row per rank, one action per cell."""
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        for rank in sorted(order):
            writer.writerow(["" if a is None else repr(a) for a in order[rank]])


def parse_order(order: Dict[int, Sequence]) -> Order:
    """``order`` with string cells parsed (cells may be strings, Actions or None)."""
    return {rank: [a if a is None or isinstance(a, Action) else Action.from_str(str(a)) for a in actions]
            for rank, actions in order.items()}


def _flat(actions: Iterable[Optional[Action]]) -> List[Action]:
    """Actions with groups expanded into their sub-actions, idle steps dropped."""
    out: List[Action] = []
    for a in actions:
        if a is None:
            continue
        out.extend(a.sub_actions if a.sub_actions else () if a.computation_type is OVERLAP_F_B else (a,))
    return out


def csv_text(order: Order, num_ranks: int) -> str:
    """The action strings torchpp's compiler reads: one line per rank, FSDP actions dropped."""
    missing = sorted(set(range(num_ranks)) - set(order))
    if missing:
        raise ValueError(f"torchpp pipeline: the action lists have no rank(s) {missing} of {num_ranks}")
    extra = sorted(set(order) - set(range(num_ranks)))
    if extra:
        raise ValueError(f"torchpp pipeline: action lists for rank(s) {extra}, outside the group of {num_ranks}")
    return "\n".join(",".join(repr(a) for a in _flat(order[r]) if a.computation_type not in FSDP_TYPES)
                     for r in range(num_ranks)) + "\n"


def to_schedule(order: Order, num_ranks: int, num_microbatches: int):
    """The ``torchpp.schedule.Schedule`` of per-rank action lists, validated."""
    from torchpp import schedule as S

    sch = S.Schedule(_schedule.from_csv(csv_text(order, num_ranks), num_ranks, num_microbatches, 1))
    sch.validate()
    return sch


class ScheduleValidationError(AssertionError):
    """An action list that is not a valid schedule (torch's validator raises AssertionError)."""


def validate_actions(actions: Dict[int, List[Optional[Action]]], pp_group_size: int, num_stages: int,
                     num_microbatches: int) -> None:
    """Checks per-rank action lists with torchpp's validator (every stage's F, I/B and W of
    every microbatch exactly once, in dependency order); torch's ``_validate_schedule``.

    Raises:
        ScheduleValidationError (an AssertionError): the message names the problem, with the
            rank x step grid.
    """
    try:
        sch = to_schedule(parse_order(actions), pp_group_size, num_microbatches)
    except (ValueError, _schedule.ScheduleError, RuntimeError) as error:
        raise ScheduleValidationError(str(error)) from None
    if sch.num_stages != num_stages:
        raise ScheduleValidationError(f"the action lists run {sch.num_stages} stages, expected {num_stages}")
