"""build_schedule: a schedule of the compiler (or one's own) bound to this rank's stages."""
from __future__ import annotations

import datetime
from typing import Callable, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from torchpp import schedule as S
from torchpp.pipeline.schedules import PipelineSchedule
from torchpp.pipeline.stage import PipelineStage


def build_schedule(
    name: Union[str, "S.Schedule"],
    stages: Union[PipelineStage, Sequence[PipelineStage]],
    n_microbatches: int,
    loss_fn: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None,
    *,
    scale_grads: bool = True,
    scatter_gather: bool = True,
    costs=None,
    memory_limit: Optional[float] = None,
    microbatch_group_size: Optional[int] = None,
    in_order_p2p: Optional[bool] = None,
    args_chunk_spec=None,
    kwargs_chunk_spec=None,
    output_merge_spec=None,
    grad_scaler=None,
    timeout: Union[None, float, datetime.timedelta] = None,
    overlap_forward_backward: bool = False,
    overlap_groups: Sequence[dist.ProcessGroup] = (),
) -> PipelineSchedule:
    """Compiles schedule ``name`` for this rank's stages.

    Args:
        name: any name of ``torchpp.schedule.SCHEDULES`` ("1f1b", "zb-h1", "interleaved-1f1b", ...),
            or a ``torchpp.schedule.Schedule`` of one's own (e.g. ``torchpp.schedule.from_csv``,
            torch's CSV format), run as given: its compute actions in its order, lowered by
            torchpp (SEND/RECV actions it may hold are replaced).
        stages: this rank's PipelineStage, or a list of them for schedules with several stages
            per rank (interleaved: model stages c*p+r; V shapes: r and 2p-1-r; DualPipe: model
            stages r and p-1-r, each a separate copy of its parameters initialised identically).
        n_microbatches: microbatches per step.
        loss_fn: ``loss_fn(output, target)`` on the last stage; must return a mean over the
            microbatch (each microbatch's loss is weighted by its share of the batch). None:
            ``step`` is a forward pass returning the outputs, as in torch; ``OUTPUT_IS_LOSS``:
            the last stage's module returns the microbatch's loss itself.
        scale_grads: weight microbatch losses so the gradients equal the full-batch gradient.
        scatter_gather: under tensor parallelism, move 1/t of each message per TP rank and
            all-gather on arrival (Megatron's scatter/gather optimization).
        costs, memory_limit, microbatch_group_size: passed to ``torchpp.schedule.generate``.
        in_order_p2p: issue every message exactly where the in-order lowering puts it, with
            the same order on both ranks of a pair (``Schedule.lowered(in_order=True)``). Needed
            by NCCL, which ignores tags and may hold a send until its receive is posted; None
            (default) turns it on for every device but CPU. Off, messages are tagged and each
            receive is posted before its consumer (``Schedule.lowered()``), which suits gloo.
        args_chunk_spec, kwargs_chunk_spec: how ``step``'s positional and keyword arguments split
            into microbatches, a spec per leaf (``torchpp.pipeline.microbatch.TensorChunkSpec(dim)``
            or ``_Replicate()``, torch's classes too). None: tensors along dim 0, anything else
            to every microbatch. The target always splits along dim 0.
        output_merge_spec: how the last stage's outputs merge (``TensorChunkSpec(dim)``, a
            ``_CustomReducer`` such as ``sum_reducer``); None: concatenated along dim 0.
        grad_scaler: a ``torch.amp.GradScaler`` (for PTD-P, ``torchpp.parallel.GradScaler``,
            whose skip decision all ranks share): each step multiplies every loss's backward
            seed by its current scale, so fp16 gradients arrive scaled (I and W passes alike)
            while ``losses`` stay unscaled. Unscale, step and update it after ``step()``, or
            let ``torchpp.parallel.DistributedOptimizer(grad_scaler=...)`` do so.
        timeout: the longest any rank waits on a peer inside a step (seconds or a
            ``timedelta``): a peer that is stopped, hung or gone makes every rank raise
            ``PipelineTimeoutError`` naming the action and the peer. None: the environment
            variable TORCHPP_PIPELINE_TIMEOUT, else 600 s; never longer than the process
            group's own timeout; 0: the group's timeout alone. On GPUs it bounds the waits
            that block the host (the step-start vote); NCCL's watchdog bounds device-side waits.
        overlap_forward_backward: run each forward and the backward of another microbatch that
            the schedule places next to it (DualPipe's overlapped pairs) at once, in two threads,
            so one's collectives (expert parallelism's all-to-all) wait while the other
            computes. CPU only. The collectives of the backward must go to twin groups
            (``torchpp.parallel.backward_groups.backward_twins``): ``parallelize`` sets this up.
        overlap_groups: the groups the stages' compute talks on (and their twins), broken with
            the pipeline's when a step fails, so neither side of a pair waits forever.

    Every step starts with a vote over the pipeline group that also compares a fingerprint
    of the schedule (name, n_microbatches, stages, lowered action lists, parameter dtype):
    ranks that built different schedules all raise ``PipelineConfigError`` naming each
    rank's values, before any message.
    """
    schedule, stage_list = compile_for_stages(name, stages, n_microbatches, costs=costs, memory_limit=memory_limit,
                                              microbatch_group_size=microbatch_group_size)
    return PipelineSchedule(schedule, stage_list, loss_fn, scale_grads, scatter_gather, in_order_p2p,
                            args_chunk_spec=args_chunk_spec, kwargs_chunk_spec=kwargs_chunk_spec,
                            output_merge_spec=output_merge_spec, grad_scaler=grad_scaler, timeout=timeout,
                            overlap_forward_backward=overlap_forward_backward, overlap_groups=overlap_groups)


def compile_for_stages(name: Union[str, "S.Schedule"], stages: Union[PipelineStage, Sequence[PipelineStage]],
                       n_microbatches: int, **options) -> Tuple["S.Schedule", List[PipelineStage]]:
    """The schedule ``name`` (compiled, or given) for the pipeline group of ``stages`` (this
    rank's), and the stages as a list. ``options``: passed to ``torchpp.schedule.generate``."""
    stage_list = [stages] if isinstance(stages, PipelineStage) else list(stages)
    if not stage_list:
        raise ValueError("torchpp pipeline: build_schedule needs at least one stage")
    groups = {st.group.group_name for st in stage_list}
    if len(groups) != 1:
        raise ValueError("torchpp pipeline: all stages of a rank must share one pipeline group")
    if isinstance(name, S.Schedule):
        return _given_schedule(name, stage_list[0].group_size, n_microbatches, options), stage_list
    chunks = len(stage_list)
    if name in ("dualpipe",):
        chunks = None  # two copies of one stage per rank, not two chunks
    schedule = S.generate(name, num_ranks=stage_list[0].group_size, num_microbatches=n_microbatches,
                          num_chunks=chunks, **options)
    return schedule, stage_list


def _given_schedule(schedule: "S.Schedule", group_size: int, n_microbatches: int, options: dict) -> "S.Schedule":
    """A user's schedule, checked against the pipeline group and the step; compute actions only."""
    given = sorted(k for k, v in options.items() if v is not None)
    if given:
        raise TypeError(f"torchpp pipeline: {given} shape a generated schedule; {schedule!r} is given as is")
    if schedule.num_ranks != group_size:
        raise ValueError(f"torchpp pipeline: {schedule!r} is for {schedule.num_ranks} ranks but the pipeline group "
                         f"has {group_size}")
    if schedule.num_microbatches != n_microbatches:
        raise ValueError(f"torchpp pipeline: {schedule!r} runs {schedule.num_microbatches} microbatches but "
                         f"n_microbatches={n_microbatches}")
    schedule = schedule.compute_only() if schedule.is_lowered else schedule
    schedule.validate()
    return schedule
