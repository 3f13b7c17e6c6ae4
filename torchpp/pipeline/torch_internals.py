"""Names torch.distributed.pipelining.schedules defines for its own Python runtime and its
lowering passes, so that code importing them migrates by changing imports. What torchpp has a
use for works (``_merge_bw``, ``_format_pipeline_order``, ``_validate_schedule``,
``_wait_batch_p2p``); torch's lowering and simulation passes raise, naming torchpp's own
(``torchpp.schedule.Schedule.lowered``, ``torchpp.schedule.simulate``): their output is torch's
internal action placement, which torchpp's C++ lowering decides differently.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional

from torchpp.pipeline import actions as A


def _merge_bw(compute_actions: List[Optional[A.Action]]) -> List[A.Action]:
    """Fuses each I immediately followed by the W of the same stage and microbatch into a B;
    idle steps are dropped."""
    merged: List[A.Action] = []
    for action in compute_actions:
        if action is None:
            continue
        previous = merged[-1] if merged else None
        if (action.computation_type is A.W and previous is not None and previous.computation_type is A.I
                and (previous.stage_index, previous.microbatch_index) == (action.stage_index, action.microbatch_index)):
            merged[-1] = A.Action(action.stage_index, A.B, action.microbatch_index)
        else:
            merged.append(action)
    return merged


def _format_pipeline_order(pipeline_order: Dict[int, List[Optional[A.Action]]],
                           error_step_number: Optional[int] = None) -> str:
    """The action lists as a table, one column per rank, one row per step (the step
    ``error_step_number`` marked)."""
    ranks = sorted(pipeline_order)
    steps = max((len(pipeline_order[r]) for r in ranks), default=0)
    cells = [[("" if i >= len(pipeline_order[r]) or pipeline_order[r][i] is None else repr(pipeline_order[r][i]))
              for r in ranks] for i in range(steps)]
    width = max([len(c) for row in cells for c in row] + [len(f"Rank {r}") for r in ranks] + [1])
    lines = ["Step   " + " ".join(f"Rank {r}".ljust(width) for r in ranks)]
    for i, row in enumerate(cells):
        mark = "<-- ERROR HERE" if i == error_step_number else ""
        lines.append(f"{i:>5}: " + " ".join(c.ljust(width) for c in row) + f" {mark}".rstrip())
    return "\n".join(lines)


def _validate_schedule(actions: Dict[int, List[Optional[A.Action]]], pp_group_size: int, num_stages: int,
                       num_microbatches: int) -> Dict[int, int]:
    """Validates per-rank action lists with torchpp's validator; returns stage -> rank.
    An invalid schedule raises ``ScheduleValidationError`` (an AssertionError, as torch's)."""
    A.validate_actions(actions, pp_group_size, num_stages, num_microbatches)
    sch = A.to_schedule(A.parse_order(actions), pp_group_size, num_microbatches)
    return dict(enumerate(sch.stage_to_rank))


def _wait_batch_p2p(work: List[Any]) -> None:
    """Waits for each of a list of ``dist.Work``."""
    for w in work:
        w.wait()


@dataclasses.dataclass
class _PipelineContext:
    """torch's context of a custom action function (see ``register_custom_function``, which
    torchpp's C++ executor does not take)."""

    schedule_ref: Any
    arg_mbs: Optional[list] = None
    kwarg_mbs: Optional[list] = None
    target_mbs: Optional[list] = None
    losses: Optional[list] = None


def _torch_pass(name: str, ours: str):
    def unsupported(*_args, **_kwargs):
        raise NotImplementedError(
            f"torchpp pipeline: {name} is one of torch's Python lowering/simulation passes; torchpp lowers and "
            f"simulates in C++ with its own placement of communication: use {ours}")

    unsupported.__name__ = name
    unsupported.__doc__ = f"torch's {name}; torchpp's counterpart is {ours} (calling this raises)."
    return unsupported


_add_send_recv = _torch_pass("_add_send_recv", "torchpp.schedule.Schedule.lowered()")
_add_unshard_reshard = _torch_pass("_add_unshard_reshard", "torchpp.parallel's ZeRO-3 (no UNSHARD/RESHARD actions)")
_add_reduce_grad = _torch_pass("_add_reduce_grad", "torchpp.parallel's data parallelism (no REDUCE_GRAD actions)")
_simulate_comms_compute = _torch_pass("_simulate_comms_compute", "torchpp.schedule.simulate(schedule)")
