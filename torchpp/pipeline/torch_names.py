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
    schedule_name = ""

    def __init__(self, stages: Union[PipelineStage, Sequence[PipelineStage]], n_microbatches: int,
                 loss_fn: Optional[Callable] = None, args_chunk_spec=None, kwargs_chunk_spec=None,
                 output_merge_spec=None, scale_grads: bool = True, backward_requires_autograd: bool = True,
                 defer_pp_recv: bool = False, *, scatter_gather: bool = True, in_order_p2p: Optional[bool] = None,
                 **schedule_options):
        """torch's arguments, in its order (the multi-stage classes' last two included: the
        receives' timing is the lowering's, so ``defer_pp_recv`` changes nothing here), then
        build_schedule's keyword options."""
        given = {"args_chunk_spec": args_chunk_spec, "kwargs_chunk_spec": kwargs_chunk_spec,
                 "output_merge_spec": output_merge_spec}
        for arg, value in given.items():
            if value is not None:
                raise ValueError(
                    f"torchpp pipeline: {type(self).__name__}({arg}={value!r}) is not supported: torchpp "
                    f"splits every tensor argument along dim 0 and concatenates outputs along dim 0"
                )
        if not backward_requires_autograd:
            raise ValueError(f"torchpp pipeline: {type(self).__name__}(backward_requires_autograd=False) is not "
                             "supported: torchpp's I and B passes run autograd")
        unknown = sorted(set(schedule_options) - set(_SCHEDULE_OPTIONS))
        if unknown:
            raise TypeError(f"torchpp pipeline: {type(self).__name__} got unexpected keyword arguments {unknown}")
        schedule, stage_list = compile_for_stages(self.schedule_name, stages, n_microbatches, **schedule_options)
        super().__init__(schedule, stage_list, loss_fn, scale_grads, scatter_gather, in_order_p2p)


class _SingleStageSchedule(_TorchNamedSchedule):
    def __init__(self, stage: PipelineStage, n_microbatches: int, loss_fn: Optional[Callable] = None,
                 args_chunk_spec=None, kwargs_chunk_spec=None, output_merge_spec=None, scale_grads: bool = True,
                 **options):
        """torch's order for one stage per rank (named ``stage``)."""
        super().__init__(stage, n_microbatches, loss_fn, args_chunk_spec, kwargs_chunk_spec, output_merge_spec,
                         scale_grads, **options)


class ScheduleGPipe(_SingleStageSchedule):
    """All forwards, then all backwards ("gpipe")."""
    schedule_name = "gpipe"


class Schedule1F1B(_SingleStageSchedule):
    """One forward, one backward in the steady state ("1f1b")."""
    schedule_name = "1f1b"


class ScheduleInterleaved1F1B(_TorchNamedSchedule):
    """Megatron's interleaved 1F1B over several stages per rank ("interleaved-1f1b")."""
    schedule_name = "interleaved-1f1b"


class ScheduleInterleavedZeroBubble(_TorchNamedSchedule):
    """Interleaved 1F1B with split backward, W's deferred into the cooldown ("interleaved-zb")."""
    schedule_name = "interleaved-zb"


class ScheduleLoopedBFS(_TorchNamedSchedule):
    """Breadth-first over the stages of a rank ("looped-bfs")."""
    schedule_name = "looped-bfs"

    def __init__(self, stages: Sequence[PipelineStage], n_microbatches: int, loss_fn: Optional[Callable] = None,
                 output_merge_spec=None, scale_grads: bool = True, backward_requires_autograd: bool = True,
                 defer_pp_recv: bool = False, **options):
        """torch's order: this class alone takes no chunk specs."""
        super().__init__(stages, n_microbatches, loss_fn, output_merge_spec=output_merge_spec,
                         scale_grads=scale_grads, backward_requires_autograd=backward_requires_autograd,
                         defer_pp_recv=defer_pp_recv, **options)


class ScheduleZBVZeroBubble(_TorchNamedSchedule):
    """Zero bubble in a V shape, two stages per rank ("zb-v")."""
    schedule_name = "zb-v"


class ScheduleDualPipeV(_TorchNamedSchedule):
    """DeepSeek's DualPipe folded into a V, two stages per rank ("dualpipe-v")."""
    schedule_name = "dualpipe-v"


TORCH_SCHEDULE_CLASSES: List[type] = [ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B,
                                      ScheduleInterleavedZeroBubble, ScheduleLoopedBFS, ScheduleZBVZeroBubble,
                                      ScheduleDualPipeV]
