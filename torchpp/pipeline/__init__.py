"""Pipeline parallelism: stages on ranks, driven by the schedule compiler's action lists.

Mirrors torch.distributed.pipelining, so migrating is a change of imports (its schedule
classes, Schedule1F1B and the rest, exist here by the same names); every schedule of the
compiler is one call away::

    from torchpp.pipeline import PipelineStage, build_schedule, split_model
    stage = PipelineStage(submodule, stage_index, num_stages, device, group=pp_group)
    sched = build_schedule("zb-h1", stage, n_microbatches=8, loss_fn=loss_fn)
    sched.step(x, target=y, losses=losses)

The executor is C++ (csrc/runtime); see docs/pipeline.md.
"""
from torchpp.pipeline import actions, microbatch, weight_grad_store
from torchpp.pipeline.actions import Action, ComputationType
from torchpp.pipeline.build import build_schedule
from torchpp.pipeline.errors import PipelineConfigError, PipelineError, PipelineShapeError, PipelineTimeoutError
from torchpp.pipeline.placement import generate_stage_to_rank_mapping
from torchpp.pipeline.schedules import OUTPUT_IS_LOSS, PipelineSchedule
from torchpp.pipeline.split import StageSequential, split_model
from torchpp.pipeline.split_linear import SplitBWLinear, split_bw_linear
from torchpp.pipeline.stage import PipelineStage
from torchpp.pipeline.torch_names import (
    _PipelineSchedule,
    _PipelineScheduleRuntime,
    _ScheduleForwardOnly,
    PipelineScheduleMulti,
    PipelineScheduleSingle,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
    get_schedule_class,
)
from torchpp.pipeline.trace import export_chrome_trace, plot_timeline
from torchpp.pipeline import tracing
from torchpp.pipeline.tracing import Pipe, SplitPoint, build_stage, pipe_split, pipeline

__all__ = [
    "_PipelineSchedule",
    "_PipelineScheduleRuntime",
    "_ScheduleForwardOnly",
    "Action",
    "ComputationType",
    "OUTPUT_IS_LOSS",
    "Pipe",
    "PipelineConfigError",
    "PipelineError",
    "PipelineSchedule",
    "PipelineScheduleMulti",
    "PipelineScheduleSingle",
    "PipelineShapeError",
    "PipelineStage",
    "PipelineTimeoutError",
    "Schedule1F1B",
    "ScheduleDualPipeV",
    "ScheduleGPipe",
    "ScheduleInterleaved1F1B",
    "ScheduleInterleavedZeroBubble",
    "ScheduleLoopedBFS",
    "ScheduleZBVZeroBubble",
    "SplitPoint",
    "StageSequential",
    "SplitBWLinear",
    "build_schedule",
    "build_stage",
    "export_chrome_trace",
    "generate_stage_to_rank_mapping",
    "get_schedule_class",
    "actions",
    "microbatch",
    "pipe_split",
    "pipeline",
    "plot_timeline",
    "split_bw_linear",
    "split_model",
    "tracing",
    "weight_grad_store",
]
