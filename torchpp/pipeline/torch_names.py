"""The schedule classes of torch.distributed.pipelining, by the same names and arguments, so
code written for torch migrates by changing its imports::

    from torchpp.pipeline import PipelineStage, Schedule1F1B    # was: torch.distributed.pipelining
    sched = Schedule1F1B(stage, n_microbatches=8, loss_fn=loss_fn)
    sched.step(x, target=y, losses=losses)

Each generated class is ``build_schedule(<name>, ...)``: the same compiler and C++ executor.
Further keyword arguments are build_schedule's (``scatter_gather``, ``in_order_p2p``, ...).
Schedules of one's own (torch's ``PipelineScheduleMulti`` subclasses that set
``pipeline_order``, ``_PipelineScheduleRuntime`` with a loaded action list) are in
custom_schedules.py.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Union

from torchpp.pipeline import actions as A
from torchpp.pipeline.build import compile_for_stages
from torchpp.pipeline.schedules import PipelineSchedule
from torchpp.pipeline.stage import PipelineStage

_SCHEDULE_OPTIONS = ("costs", "memory_limit", "microbatch_group_size")

# A multi-stage class given one stage per rank runs the one-chunk schedule of the same family,
# as torch's classes do with a single local stage.
_ONE_CHUNK = {"interleaved-1f1b": "1f1b", "looped-bfs": "gpipe", "interleaved-zb": "zb-h1"}
_V_SHAPES = ("zb-v", "dualpipe-v")


def _stage_list(stages: Union[PipelineStage, Sequence[PipelineStage]]) -> List[PipelineStage]:
    return [stages] if isinstance(stages, PipelineStage) else list(stages)


class _TorchNamedSchedule(PipelineSchedule):
    """torch's ``_PipelineSchedule``: the base of every schedule class here."""

    schedule_name = ""  # the compiler's; empty for schedules whose actions the user gives

    def __init__(self, stages: Union[PipelineStage, Sequence[PipelineStage]], n_microbatches: int,
                 loss_fn: Optional[Callable] = None, args_chunk_spec=None, kwargs_chunk_spec=None,
                 output_merge_spec=None, scale_grads: bool = True, backward_requires_autograd: bool = True,
                 defer_pp_recv: bool = False, *, scatter_gather: bool = True, in_order_p2p: Optional[bool] = None,
                 grad_scaler=None, timeout=None, **schedule_options):
        """torch's arguments, in its order (the multi-stage classes' last two included: the
        receives' timing is the lowering's, so ``defer_pp_recv`` changes nothing here), then
        build_schedule's keyword options. ``loss_fn=None`` makes ``step`` forward only, as in
        torch."""
        if not backward_requires_autograd:
            raise ValueError(f"torchpp pipeline: {type(self).__name__}(backward_requires_autograd=False) is not "
                             "supported: torchpp's I and B passes run autograd")
        unknown = sorted(set(schedule_options) - set(_SCHEDULE_OPTIONS))
        if unknown:
            raise TypeError(f"torchpp pipeline: {type(self).__name__} got unexpected keyword arguments {unknown}")
        stage_list = _stage_list(stages)
        if not stage_list:
            raise ValueError(f"torchpp pipeline: {type(self).__name__} needs at least one stage")
        schedule = None
        if self.schedule_name:
            name = self.schedule_name
            if len(stage_list) == 1 and name in _V_SHAPES:
                raise ValueError(f"torchpp pipeline: {type(self).__name__} places two stages on each rank (a V); "
                                 f"this rank passed one ({stage_list[0]!r})")
            name = _ONE_CHUNK.get(name, name) if len(stage_list) == 1 else name
            schedule, stage_list = compile_for_stages(name, stage_list, n_microbatches, **schedule_options)
        elif schedule_options:
            raise TypeError(f"torchpp pipeline: {sorted(schedule_options)} shape a generated schedule; "
                            f"{type(self).__name__} runs the action lists it is given")
        super().__init__(schedule, stage_list, loss_fn, scale_grads, scatter_gather, in_order_p2p,
                         args_chunk_spec=args_chunk_spec, kwargs_chunk_spec=kwargs_chunk_spec,
                         output_merge_spec=output_merge_spec, grad_scaler=grad_scaler, timeout=timeout,
                         n_microbatches=n_microbatches)
        self._n_microbatches = n_microbatches
        self._num_stages = stage_list[0].num_stages
        self.pp_group_size = stage_list[0].group_size
        self._stages = stage_list
        if schedule is None:  # torch's default placement until the action lists say otherwise
            from torchpp.pipeline.placement import generate_stage_to_rank_mapping
            self.stage_index_to_group_rank = generate_stage_to_rank_mapping(self.pp_group_size, self._num_stages)

    @property
    def stage_index_to_group_rank(self) -> Dict[int, int]:
        """Stage index -> pipeline rank (torch's attribute)."""
        if self.schedule is not None:
            return dict(enumerate(self.schedule.stage_to_rank))
        return self._placement

    @stage_index_to_group_rank.setter
    def stage_index_to_group_rank(self, mapping: Dict[int, int]) -> None:
        self._placement = dict(mapping)

    @property
    def pipeline_order(self) -> A.Order:
        """Per rank, the compute actions in order (torch's attribute); set it to run one's own."""
        if getattr(self, "_order", None) is None and self.schedule is not None:
            sch = self.schedule.compute_only()
            self._order = {r: [A.Action.from_str(a) for a in sch.actions(r)] for r in range(sch.num_ranks)}
        return self._order if getattr(self, "_order", None) is not None else {}

    @pipeline_order.setter
    def pipeline_order(self, order: Dict[int, Sequence]) -> None:
        self._order = A.parse_order(order)
        self.schedule = None  # bound again from the new lists at the next step

    def _schedule_from_order(self):
        order = getattr(self, "pipeline_order_with_comms", None) or self.pipeline_order
        if not order:
            return super()._schedule_from_order()
        return A.to_schedule(A.parse_order(order), self.pp_group_size, self._n_microbatches)

    def _validate_and_set_stage_mapping(self, actions: Dict[int, Sequence]) -> None:
        """Validates per-rank action lists and takes the placement they imply (torch's method)."""
        sch = A.to_schedule(A.parse_order(actions), self.pp_group_size, self._n_microbatches)
        self.stage_index_to_group_rank = dict(enumerate(sch.stage_to_rank))

    def _dump_csv(self, filename: str) -> None:
        """Writes ``pipeline_order`` as torch's CSV (one row per rank)."""
        A.write_csv(self.pipeline_order, filename)

    def _load_csv(self, filename: str, format: str = "compute_only") -> None:
        """Reads ``pipeline_order`` from torch's CSV and validates it."""
        if format != "compute_only":
            raise ValueError(f"torchpp pipeline: {type(self).__name__}._load_csv takes format='compute_only', got "
                             f"{format!r} (_PipelineScheduleRuntime also reads 'compute_comms')")
        self.pipeline_order = A.read_csv(filename)
        self._validate_and_set_stage_mapping(self.pipeline_order)


_PipelineSchedule = _TorchNamedSchedule


class PipelineScheduleMulti(_TorchNamedSchedule):
    """torch's base of the schedules with several stages per rank. Subclass it and set
    ``self.pipeline_order`` (per rank, a list of actions such as ``_Action(0, F, 0)`` or
    "0F0"; None for an idle step) to run a schedule of one's own on torchpp's executor."""

    def __init__(self, stages: Sequence[PipelineStage], n_microbatches: int, loss_fn: Optional[Callable] = None,
                 args_chunk_spec=None, kwargs_chunk_spec=None, output_merge_spec=None,
                 use_full_backward: Optional[bool] = None, scale_grads: bool = True,
                 backward_requires_autograd: bool = True, **options):
        """torch's order for several stages per rank (``use_full_backward`` is deprecated in
        torch and ignored here too)."""
        super().__init__(stages, n_microbatches, loss_fn, args_chunk_spec, kwargs_chunk_spec, output_merge_spec,
                         scale_grads, backward_requires_autograd, **options)


class PipelineScheduleSingle(_TorchNamedSchedule):
    """torch's base of the schedules with one stage per rank."""

    def __init__(self, stage: PipelineStage, n_microbatches: int, loss_fn: Optional[Callable] = None,
                 args_chunk_spec=None, kwargs_chunk_spec=None, output_merge_spec=None, scale_grads: bool = True,
                 **options):
        """torch's order for one stage per rank (named ``stage``)."""
        if not self.schedule_name:
            raise TypeError(f"torchpp pipeline: {type(self).__name__} is an abstract base, as torch's (its subclasses "
                            "implement _step_microbatches in Python; torchpp's actions run in C++): use a schedule "
                            "class, or PipelineScheduleMulti / _PipelineScheduleRuntime with action lists of one's "
                            "own")
        super().__init__(stage, n_microbatches, loss_fn, args_chunk_spec, kwargs_chunk_spec, output_merge_spec,
                         scale_grads, **options)


class ScheduleGPipe(PipelineScheduleSingle):
    """All forwards, then all backwards ("gpipe")."""
    schedule_name = "gpipe"


class _ScheduleForwardOnly(PipelineScheduleSingle):
    """Forward passes only, whatever ``loss_fn`` (torch's ``_ScheduleForwardOnly``)."""
    schedule_name = "gpipe"
    _forward_only = True


class Schedule1F1B(PipelineScheduleSingle):
    """One forward, one backward in the steady state ("1f1b")."""
    schedule_name = "1f1b"


class _PipelineScheduleRuntime(PipelineScheduleMulti):
    """torch's runtime of an action list: load one (``_prepare_schedule_with_comms``,
    ``_load_csv``), and ``step`` runs it on torchpp's C++ executor. torchpp lowers the compute
    actions itself: SEND/RECV actions of a "compute_comms" list are replaced by torchpp's (where
    each receive is posted is the lowering's choice; the arithmetic is the same)."""

    def __init__(self, stages: Sequence[PipelineStage], n_microbatches: int, loss_fn: Optional[Callable] = None,
                 *args, stage_index_to_group_rank: Optional[Dict[int, int]] = None, **kwargs):
        super().__init__(stages, n_microbatches, loss_fn, *args, **kwargs)
        self.pipeline_order_with_comms: A.Order = {}
        if stage_index_to_group_rank is not None and self.schedule is None:
            self.stage_index_to_group_rank = stage_index_to_group_rank

    def _prepare_schedule_with_comms(self, actions: Dict[int, Sequence], format: str = "compute_only") -> None:
        """Takes per-rank action lists ("compute_only", or "compute_comms" with SEND/RECV) to run
        from the next step on; validates them and lowers them with torchpp's lowering."""
        order = A.parse_order(actions)
        if format == "compute_only":
            comms = [(r, i, a) for r, acts in order.items() for i, a in enumerate(acts)
                     if a is not None and not a.is_compute_op and a.computation_type not in A.FSDP_TYPES]
            if comms:
                rank, i, action = comms[0]
                raise ValueError(f"torchpp pipeline: format='compute_only' but rank {rank} has the communication "
                                 f"action {action!r} at position {i}; use format='compute_comms'")
        elif format != "compute_comms":
            raise NotImplementedError(f"torchpp pipeline: format={format!r}; expected 'compute_only' or "
                                      "'compute_comms'")
        schedule = A.to_schedule(order, self.pp_group_size, self._n_microbatches)
        self._bind(schedule)
        compute = schedule.compute_only()
        self._order = {r: [A.Action.from_str(a) for a in compute.actions(r)] for r in range(compute.num_ranks)}
        self.pipeline_order_with_comms = {r: [A.Action.from_str(a) for a in self.lowered.actions(r)]
                                          for r in range(self.lowered.num_ranks)}

    def _load_csv(self, filename: str, format: str = "compute_only") -> None:
        """Reads an action list from torch's CSV ("compute_only" or "compute_comms") to run."""
        self._prepare_schedule_with_comms(A.read_csv(filename), format=format)

    def _dump_csv(self, filename: str, format: str = "compute_comms") -> None:
        """Writes the action lists as torch's CSV: with torchpp's SEND/RECV ("compute_comms") or without."""
        if format not in ("compute_only", "compute_comms"):
            raise NotImplementedError(f"torchpp pipeline: format={format!r}; expected 'compute_only' or "
                                      "'compute_comms'")
        self._ensure_bound()
        if format == "compute_comms" and not self.pipeline_order_with_comms:
            self.pipeline_order_with_comms = {r: [A.Action.from_str(a) for a in self.lowered.actions(r)]
                                              for r in range(self.lowered.num_ranks)}
        A.write_csv(self.pipeline_order if format == "compute_only" else self.pipeline_order_with_comms, filename)

    def register_custom_function(self, computation_type, custom_function) -> None:
        """torch runs each action in Python and lets a function replace one kind of action;
        torchpp's executor runs the action lists in C++, so there is nothing to replace."""
        raise NotImplementedError(
            f"torchpp pipeline: register_custom_function({computation_type!r}, ...) replaces how torch's Python "
            "runtime executes an action; torchpp runs the action lists in C++ (csrc/runtime), calling Python only "
            "for a stage's forward. Customise the stage module (its forward, dw_builder) or the action lists "
            "instead")


class _GeneratedMulti(_PipelineScheduleRuntime):
    """A multi-stage schedule class of the compiler, with torch's constructor arguments."""

    def __init__(self, stages: Sequence[PipelineStage], n_microbatches: int, loss_fn: Optional[Callable] = None,
                 args_chunk_spec=None, kwargs_chunk_spec=None, output_merge_spec=None, scale_grads: bool = True,
                 backward_requires_autograd: bool = True, defer_pp_recv: bool = False, **options):
        """torch's order (``defer_pp_recv`` changes nothing: receives are posted where the lowering puts them)."""
        _TorchNamedSchedule.__init__(self, stages, n_microbatches, loss_fn, args_chunk_spec, kwargs_chunk_spec,
                                     output_merge_spec, scale_grads, backward_requires_autograd, defer_pp_recv,
                                     **options)
        self.pipeline_order_with_comms = {}


class ScheduleInterleaved1F1B(_GeneratedMulti):
    """Megatron's interleaved 1F1B over several stages per rank ("interleaved-1f1b")."""
    schedule_name = "interleaved-1f1b"


class ScheduleInterleavedZeroBubble(_GeneratedMulti):
    """Interleaved 1F1B with split backward, W's deferred into the cooldown ("interleaved-zb")."""
    schedule_name = "interleaved-zb"


class ScheduleLoopedBFS(_GeneratedMulti):
    """Breadth-first over the stages of a rank ("looped-bfs")."""
    schedule_name = "looped-bfs"

    def __init__(self, stages: Sequence[PipelineStage], n_microbatches: int, loss_fn: Optional[Callable] = None,
                 output_merge_spec=None, scale_grads: bool = True, backward_requires_autograd: bool = True,
                 defer_pp_recv: bool = False, **options):
        """torch's order: this class alone takes no chunk specs."""
        super().__init__(stages, n_microbatches, loss_fn, output_merge_spec=output_merge_spec,
                         scale_grads=scale_grads, backward_requires_autograd=backward_requires_autograd,
                         defer_pp_recv=defer_pp_recv, **options)


class ScheduleZBVZeroBubble(_GeneratedMulti):
    """Zero bubble in a V shape, two stages per rank ("zb-v")."""
    schedule_name = "zb-v"


class ScheduleDualPipeV(_GeneratedMulti):
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
