"""The schedule classes of torch.distributed.pipelining, by the same names and arguments, so
code written for torch migrates by changing its imports::

    from torchpp.pipeline import PipelineStage, Schedule1F1B    # was: torch.distributed.pipelining
    sched = Schedule1F1B(stage, n_microbatches=8, loss_fn=loss_fn)
    sched.step(x, target=y, losses=losses)

Each is ``build_schedule(<name>, ...)``: the same compiler and C++ executor. Further
keyword arguments are build_schedule's (``scatter_gather``, ``in_order_p2p``, ...).
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Union

from torchpp.pipeline.schedules import PipelineSchedule, compile_for_stages
from torchpp.pipeline.stage import PipelineStage

_SCHEDULE_OPTIONS = ("costs", "memory_limit", "microbatch_group_size")


class _TorchNamedSchedule(PipelineSchedule):
    schedule_name = ""  # the compiler's; empty in the abstract bases

    def __init__(self, stages: Union[PipelineStage, Sequence[PipelineStage]], n_microbatches: int,
                 loss_fn: Optional[Callable] = None, args_chunk_spec=None, kwargs_chunk_spec=None,
                 output_merge_spec=None, scale_grads: bool = True, backward_requires_autograd: bool = True,
                 defer_pp_recv: bool = False, *, scatter_gather: bool = True, in_order_p2p: Optional[bool] = None,
                 grad_scaler=None, timeout=None, **schedule_options):
        """torch's arguments, in its order (the multi-stage classes' last two included: the
        receives' timing is the lowering's, so ``defer_pp_recv`` changes nothing here), then
        build_schedule's keyword options."""
        if not self.schedule_name:
            raise TypeError(f"torchpp pipeline: {type(self).__name__} is an abstract base (torch's subclasses "
                            "implement their own step); use a schedule class, or build_schedule with any "
                            "schedule of the compiler or a torchpp.schedule.Schedule of one's own")
        if not backward_requires_autograd:
            raise ValueError(f"torchpp pipeline: {type(self).__name__}(backward_requires_autograd=False) is not "
                             "supported: torchpp's I and B passes run autograd")
        unknown = sorted(set(schedule_options) - set(_SCHEDULE_OPTIONS))
        if unknown:
            raise TypeError(f"torchpp pipeline: {type(self).__name__} got unexpected keyword arguments {unknown}")
        schedule, stage_list = compile_for_stages(self.schedule_name, stages, n_microbatches, **schedule_options)
        super().__init__(schedule, stage_list, loss_fn, scale_grads, scatter_gather, in_order_p2p,
                         args_chunk_spec=args_chunk_spec, kwargs_chunk_spec=kwargs_chunk_spec,
                         output_merge_spec=output_merge_spec, grad_scaler=grad_scaler, timeout=timeout)


class PipelineScheduleMulti(_TorchNamedSchedule):
    """torch's base of the schedules with several stages per rank (for isinstance checks)."""


class PipelineScheduleSingle(_TorchNamedSchedule):
    """torch's base of the schedules with one stage per rank (for isinstance checks)."""

    def __init__(self, stage: PipelineStage, n_microbatches: int, loss_fn: Optional[Callable] = None,
                 args_chunk_spec=None, kwargs_chunk_spec=None, output_merge_spec=None, scale_grads: bool = True,
                 **options):
        """torch's order for one stage per rank (named ``stage``)."""
        super().__init__(stage, n_microbatches, loss_fn, args_chunk_spec, kwargs_chunk_spec, output_merge_spec,
                         scale_grads, **options)


class ScheduleGPipe(PipelineScheduleSingle):
    """All forwards, then all backwards ("gpipe")."""
    schedule_name = "gpipe"


class Schedule1F1B(PipelineScheduleSingle):
    """One forward, one backward in the steady state ("1f1b")."""
    schedule_name = "1f1b"


class ScheduleInterleaved1F1B(PipelineScheduleMulti):
    """Megatron's interleaved 1F1B over several stages per rank ("interleaved-1f1b")."""
    schedule_name = "interleaved-1f1b"


class ScheduleInterleavedZeroBubble(PipelineScheduleMulti):
    """Interleaved 1F1B with split backward, W's deferred into the cooldown ("interleaved-zb")."""
    schedule_name = "interleaved-zb"


class ScheduleLoopedBFS(PipelineScheduleMulti):
    """Breadth-first over the stages of a rank ("looped-bfs")."""
    schedule_name = "looped-bfs"

    def __init__(self, stages: Sequence[PipelineStage], n_microbatches: int, loss_fn: Optional[Callable] = None,
                 output_merge_spec=None, scale_grads: bool = True, backward_requires_autograd: bool = True,
                 defer_pp_recv: bool = False, **options):
        """torch's order: this class alone takes no chunk specs."""
        super().__init__(stages, n_microbatches, loss_fn, output_merge_spec=output_merge_spec,
                         scale_grads=scale_grads, backward_requires_autograd=backward_requires_autograd,
                         defer_pp_recv=defer_pp_recv, **options)


class ScheduleZBVZeroBubble(PipelineScheduleMulti):
    """Zero bubble in a V shape, two stages per rank ("zb-v")."""
    schedule_name = "zb-v"


class ScheduleDualPipeV(PipelineScheduleMulti):
    """DeepSeek's DualPipe folded into a V, two stages per rank ("dualpipe-v")."""
    schedule_name = "dualpipe-v"


TORCH_SCHEDULE_CLASSES: List[type] = [ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B,
                                      ScheduleInterleavedZeroBubble, ScheduleLoopedBFS, ScheduleZBVZeroBubble,
                                      ScheduleDualPipeV]

# torch's names for get_schedule_class (matched case-insensitively, as torch does).
_BY_TORCH_NAME = {"1F1B": Schedule1F1B, "Interleaved1F1B": ScheduleInterleaved1F1B, "GPipe": ScheduleGPipe,
                  "LoopedBFS": ScheduleLoopedBFS, "InterleavedZeroBubble": ScheduleInterleavedZeroBubble,
                  "PipelineScheduleSingle": PipelineScheduleSingle, "PipelineScheduleMulti": PipelineScheduleMulti,
                  "ZBVZeroBubble": ScheduleZBVZeroBubble, "DualPipeV": ScheduleDualPipeV}


def get_schedule_class(schedule_name: str) -> type:
    """The class torch's ``get_schedule_class`` maps ``schedule_name`` to (e.g. "1F1B",
    "interleaved1f1b", "ZBVZeroBubble"), torchpp's of the same name."""
    by_lower = {k.lower(): cls for k, cls in _BY_TORCH_NAME.items()}
    if schedule_name.lower() not in by_lower:
        raise ValueError(f"torchpp pipeline: unknown schedule name {schedule_name!r}; torch's names are "
                         f"{list(_BY_TORCH_NAME)} (torchpp.schedule.SCHEDULES has the compiler's, for build_schedule)")
    return by_lower[schedule_name.lower()]
