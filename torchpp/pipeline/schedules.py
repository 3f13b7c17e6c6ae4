"""PipelineSchedule, the step() users call (build_schedule in build.py makes one).

The order of work comes from the schedule compiler (torchpp.schedule); the C++ executor
(csrc/runtime) runs this rank's lowered action list and calls back here only to run a stage's
forward (and the loss on a last stage).
"""
from __future__ import annotations

import datetime
import hashlib
import os
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from torchpp import _C
from torchpp import schedule as S
from torchpp.pipeline import split_modules, twins
from torchpp.pipeline.errors import PipelineError
from torchpp.pipeline.microbatch import merge_chunks
from torchpp.pipeline.stage import PipelineStage
from torchpp.pipeline.step_inputs import StepInputs
from torchpp.pipeline.trace import parse_action
from torchpp.tensor_parallel.utils import share_summed_grads


class _OutputIsLoss:
    def __repr__(self) -> str:
        return "OUTPUT_IS_LOSS"


# loss_fn for stages whose last module returns the microbatch's loss itself (Megatron's
# models, TorchScript stages computing their loss); torch has no such option.
OUTPUT_IS_LOSS = _OutputIsLoss()

# The longest a rank waits on a peer inside a step unless build_schedule(timeout=) or
# TORCHPP_PIPELINE_TIMEOUT says otherwise (torch's NCCL default; gloo's own is 30 minutes).
DEFAULT_TIMEOUT_S = 600.0
TIMEOUT_ENV = "TORCHPP_PIPELINE_TIMEOUT"

# What a stage returns, and the next stage receives as its positional arguments.
StageOutput = Union[torch.Tensor, Tuple[torch.Tensor, ...]]


def _is_stage_output(output) -> bool:
    if isinstance(output, torch.Tensor):
        return True
    return isinstance(output, (tuple, list)) and len(output) > 0 and all(isinstance(t, torch.Tensor) for t in output)


def _detached(output: StageOutput) -> StageOutput:
    return output.detach() if isinstance(output, torch.Tensor) else tuple(t.detach() for t in output)


def timeout_seconds(timeout: Union[None, float, datetime.timedelta]) -> float:
    """The pipeline timeout in seconds: ``timeout`` if given, else TORCHPP_PIPELINE_TIMEOUT,
    else DEFAULT_TIMEOUT_S; 0 leaves waits to the process group's own timeout."""
    if timeout is None:
        text = os.environ.get(TIMEOUT_ENV)
        if text is None:
            return DEFAULT_TIMEOUT_S
        try:
            timeout = float(text)
        except ValueError:
            raise ValueError(f"torchpp pipeline: {TIMEOUT_ENV}={text!r} is not a number of seconds") from None
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    seconds = float(timeout)
    if not seconds >= 0:
        raise ValueError(f"torchpp pipeline: timeout must be a non-negative number of seconds, got {timeout!r}")
    return seconds


class PipelineSchedule(StepInputs):
    """A compiled schedule bound to this rank's stages; call ``step`` once per batch.

    Built by ``build_schedule``; see there for the arguments.
    """

    def __init__(self, schedule: Optional["S.Schedule"], stages: List[PipelineStage], loss_fn, scale_grads: bool,
                 scatter_gather: bool, in_order_p2p: Optional[bool] = None, *, args_chunk_spec=None,
                 kwargs_chunk_spec=None, output_merge_spec=None, grad_scaler=None, timeout=None,
                 overlap_forward_backward: bool = False, overlap_groups: Sequence[dist.ProcessGroup] = (),
                 n_microbatches: Optional[int] = None):
        self.overlap_forward_backward = bool(overlap_forward_backward)
        self._overlap_groups = list(overlap_groups)
        self.timeout = timeout_seconds(timeout)
        self.args_chunk_spec = args_chunk_spec
        self.kwargs_chunk_spec = kwargs_chunk_spec
        self.output_merge_spec = output_merge_spec
        first = stages[0]
        # NCCL matches messages by order and may hold a send until its receive is posted.
        self.in_order_p2p = first.device.type != "cpu" if in_order_p2p is None else bool(in_order_p2p)
        if loss_fn is not None and loss_fn is not OUTPUT_IS_LOSS and not callable(loss_fn):
            raise TypeError(f"torchpp pipeline: loss_fn must be callable, None (forward only) or OUTPUT_IS_LOSS, "
                            f"got {loss_fn!r}")
        self.loss_fn = loss_fn
        self.scale_grads = scale_grads
        self.grad_scaler = grad_scaler
        # Whether a loss is multiplied before its backward: by its microbatch's share, the loss scale, or both.
        self._weighted_seed = scale_grads or grad_scaler is not None
        self.group = first.group
        self.rank = first.group_rank
        self.device = first.device
        self.stages = stages
        self._tp_group = first.tp_group
        self._scatter_gather_wanted = scatter_gather
        self._signatures: Dict[str, tuple] = {}  # per executor: its last step's input shapes
        self._inputs: Optional[List[torch.Tensor]] = None
        self._arguments: Optional[List[tuple]] = None  # per microbatch: the first stage's (args, kwargs)
        self._targets: Optional[List[torch.Tensor]] = None
        self._weights: List[float] = []
        self._losses: Dict[int, torch.Tensor] = {}
        self._outputs: Dict[int, torch.Tensor] = {}
        self._loss_kwargs: dict = {}
        self.schedule: Optional["S.Schedule"] = None
        self.num_microbatches = schedule.num_microbatches if schedule is not None else n_microbatches
        if schedule is not None:
            self._bind(schedule)

    def _bind(self, schedule: "S.Schedule") -> None:
        """Places this rank's stages by ``schedule`` and builds its executor (again, for a new schedule)."""
        if self.num_microbatches is not None and schedule.num_microbatches != self.num_microbatches:
            raise ValueError(f"torchpp pipeline: {schedule!r} runs {schedule.num_microbatches} microbatches but "
                             f"n_microbatches={self.num_microbatches}")
        self.schedule = schedule
        self.num_microbatches = schedule.num_microbatches
        self.lowered = schedule.lowered(in_order=self.in_order_p2p)
        self._stage_of = self._place(self.stages)
        for st in self.stages:
            st.stage_index_to_group_rank = {s: schedule.stage_to_rank[s] for s in range(schedule.num_stages)}
        self._split_backward_layers()
        if schedule.num_pipelines == 2:
            self._twin_params = twins.flag_twin_parameters(self)
        spp = schedule.num_stages // schedule.num_pipelines
        self._stages_per_pipeline = spp
        self._has_first = any(s % spp == 0 for s in self._stage_of)
        self._has_last = any(s % spp == spp - 1 for s in self._stage_of)
        tp_group = self._tp_group
        self._scatter_gather = bool(self._scatter_gather_wanted and tp_group is not None and tp_group.size() > 1)
        self._script = self._script_stages(self.loss_fn, self._weighted_seed, spp)
        self._signatures.clear()
        self._executor = self._make_executor(self.lowered)
        self._eval_executor = None  # built by the first eval()

    def _make_executor(self, lowered: "S.Schedule"):
        """The C++ executor of this rank's actions in ``lowered``."""
        tp_group = self._tp_group
        groups = [self.group.group_name] + ([tp_group.group_name] if tp_group is not None else [])
        # A failing side of an overlapped pair breaks these, so the other side's collective returns.
        groups += [g.group_name for g in self._overlap_groups if g.group_name not in groups]
        return _C.Executor(
            rank=self.rank,
            actions=lowered.actions(self.rank),
            stage_to_rank=self.schedule.stage_to_rank,
            stages_per_pipeline=self._stages_per_pipeline,
            pp_group=self.group.group_name,
            tp_group=tp_group.group_name if tp_group is not None else "",
            tp_rank=dist.get_rank(tp_group) if tp_group is not None else 0,
            tp_size=tp_group.size() if tp_group is not None else 1,
            scatter_gather=self._scatter_gather,
            in_order=self.in_order_p2p,
            abort_groups=groups,
            device=self.device,
            expected_inputs={s: st.input_tensors for s, st in self._stage_of.items() if st.input_tensors},
            expected_outputs={s: st.output_tensors for s, st in self._stage_of.items() if st.output_tensors},
            backward_hooked_stages={s for s, st in self._stage_of.items() if st.dw_builder is not None},
            forward=None if self._script is not None else self._forward,
            after_backward=self._after_backward,
            script=self._script,
            timeout_s=self.timeout,
            fingerprint=self._fingerprint(lowered),
            overlap_forward_backward=self.overlap_forward_backward,
        )

    def _fingerprint(self, lowered: "S.Schedule") -> List[Tuple[str, str]]:
        """What every rank's executor of ``lowered`` must agree on; each step's start vote
        compares it across the pipeline group (an empty value: unknown here, matches any)."""
        sch = self.schedule
        actions = "\n".join(",".join(lowered.actions(r)) for r in range(sch.num_ranks))
        dtypes = sorted({str(p.dtype).replace("torch.", "") for st in self.stages for p in st.submod.parameters()
                         if p.is_floating_point()})
        return [
            ("schedule", sch.name),
            ("n_microbatches", str(sch.num_microbatches)),
            ("stages", str(sch.num_stages)),
            ("pipelines", str(sch.num_pipelines)),
            ("p2p", "in-order" if self.in_order_p2p else "tagged"),
            ("lowered actions (hash)", hashlib.blake2b(actions.encode(), digest_size=8).hexdigest()),
            ("parameter dtype", ",".join(dtypes)),
            ("forward-backward overlap", "on" if self.overlap_forward_backward else "off"),
        ]

    def _place(self, stages: List[PipelineStage]) -> Dict[int, PipelineStage]:
        """Maps each schedule stage this rank runs to the PipelineStage holding its parameters."""
        sch = self.schedule
        by_model_stage = {st.stage_index: st for st in stages}
        model_stages = sch.num_stages // sch.num_pipelines
        for st in stages:
            if st.num_stages != model_stages:
                raise ValueError(
                    f"torchpp pipeline: schedule {sch.name!r} has {model_stages} model stages but "
                    f"{st!r} says num_stages={st.num_stages}"
                )
        mine = [s for s, r in enumerate(sch.stage_to_rank) if r == self.rank]
        wanted = sorted({sch.model_stage(s) for s in mine})
        if sorted(by_model_stage) != wanted:
            raise ValueError(
                f"torchpp pipeline: schedule {sch.name!r} places model stages {wanted} on pipeline rank "
                f"{self.rank} (stage_to_rank={sch.stage_to_rank}), but this rank passed stages "
                f"{sorted(by_model_stage)}"
            )
        return {s: by_model_stage[sch.model_stage(s)] for s in mine}

    def _split_backward_layers(self) -> None:
        """Puts each stage's plain linears on the split op where the schedule has W passes for
        it (or its ``split_bw`` says so), so those passes carry the weight gradients."""
        actions = map(parse_action, self.schedule.actions(self.rank))
        with_w = {self.schedule.model_stage(stage) for stage, kind, _ in actions if kind == "W"}
        for st in self.stages:
            wanted = st.split_bw if st.split_bw is not None else st.stage_index in with_w
            if wanted:
                st.split_bw_modules = split_modules.split_linears(st.submod)
            elif st.split_bw is False:
                split_modules.unsplit_linears(st.submod)
                st.split_bw_modules = []

    def _script_stages(self, loss_fn, weighted_seed: bool, spp: int):
        """TorchScript stages (and loss) run from C++ without entering Python; None otherwise."""
        scripted = all(isinstance(st.submod, torch.jit.ScriptModule) and st.dw_builder is None
                       for st in self._stage_of.values())
        loss_ok = not self._has_last or loss_fn is OUTPUT_IS_LOSS or isinstance(loss_fn, torch.jit.ScriptModule)
        if not (scripted and loss_ok):
            return None
        modules = {s: st.submod for s, st in self._stage_of.items()}
        script_loss = loss_fn if self._has_last and loss_fn is not OUTPUT_IS_LOSS else None  # None: output is loss
        return _C.ScriptStages(modules, script_loss, spp, weighted_seed,
                               expected_outputs={s: st.output_tensors for s, st in self._stage_of.items()
                                                 if st.output_tensors and s % spp == spp - 1})

    @property
    def torchscript_stages(self) -> bool:
        """Whether this rank's stages (and loss) run as TorchScript from C++, without Python."""
        return self._script is not None

    # ---- the executor's callback ----
    def _forward(self, stage: int, microbatch: int, inputs: List[torch.Tensor]) -> StageOutput:
        spp = self._stages_per_pipeline
        module = self._stage_of[stage]._forward_fn
        if stage % spp == 0:  # a first stage: the batch's microbatch and its further arguments
            args, kwargs = self._arguments[microbatch]
            output = module(self._inputs[microbatch], *args, **kwargs)
        else:  # the previous stage's output: one tensor, or each of its tuple's in turn
            output = module(*inputs)
        if stage % spp != spp - 1:
            return output  # the executor checks it is a Tensor or a tuple of Tensors
        if not _is_stage_output(output):
            raise TypeError(
                f"stage {stage} returned a {type(output).__name__} for microbatch {microbatch}; "
                f"a pipeline stage must return a Tensor or a tuple of Tensors"
            )
        expected = self._stage_of[stage].output_tensors
        if expected:
            _C.check_stage_output(stage, microbatch, [output] if isinstance(output, torch.Tensor) else output, expected)
        if self.loss_fn is None or (self.loss_fn is not OUTPUT_IS_LOSS and self._targets is None):
            self._outputs[microbatch] = _detached(output)  # forward only, or eval() without target
            return output
        if self.loss_fn is OUTPUT_IS_LOSS:
            loss = output
        else:
            loss = self.loss_fn(output, self._targets[microbatch], **self._loss_kwargs)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError(f"the loss of microbatch {microbatch} must be a one-element tensor, got {loss!r}")
        self._losses[microbatch] = loss.detach()
        self._outputs[microbatch] = _detached(output)
        # Weighted by the microbatch's share of the batch, the summed gradients are the batch's.
        return loss * self._weights[microbatch] if self._weighted_seed else loss

    def _after_backward(self, stage: int, microbatch: int, split: bool) -> None:
        """The executor's hook after the backward of a stage with a ``dw_builder`` (torch's rule)."""
        runner = self._stage_of[stage].dw_builder()
        if not split:
            runner()
        elif not _C.wgrad_defer(runner):  # the executor captures during an I pass: cannot happen
            raise RuntimeError(f"torchpp pipeline: no weight-gradient capture for stage {stage} microbatch {microbatch}")

    def step(self, *args, target: Optional[torch.Tensor] = None, losses: Optional[list] = None,
             return_outputs: bool = True, loss_kwargs: Optional[dict] = None, **kwargs) -> Optional[StageOutput]:
        """Runs forward and backward of one batch over the pipeline; gradients accumulate in .grad.

        Args:
            *args, **kwargs: the first stage's arguments, on ranks that hold a first stage
                (nothing elsewhere): the batch tensor, then any further arguments. They split
                into microbatches by the schedule's chunk specs (default: tensors along dim 0,
                anything else to every microbatch as is); stages after the first receive only
                the previous stage's output.
            target: the batch's target on ranks that hold a last stage (passed to loss_fn).
            losses: if a list, on ranks holding a last stage it is cleared and refilled with
                this step's per-microbatch losses (unscaled), as torch does; untouched elsewhere.
            return_outputs: False returns None everywhere (the outputs are not concatenated).
            loss_kwargs: further keyword arguments of every microbatch's ``loss_fn`` call.

        Returns:
            On ranks holding a last stage, the outputs of its microbatches merged by the
            ``output_merge_spec`` (default: concatenated along dim 0, entry by entry if the
            last stage returns a tuple); None elsewhere. With ``loss_fn=None`` (torch's
            forward-only schedule) the step is ``eval``'s: forward passes alone, outputs returned.
        """
        self._ensure_bound()
        if self.loss_fn is None or self._forward_only:
            return self._run_eval(args, kwargs, None, losses, return_outputs, loss_kwargs)
        if not torch.is_grad_enabled():
            raise RuntimeError("torchpp pipeline: step() runs a backward and cannot run under torch.no_grad(); "
                               "call eval() for a forward-only pass")
        twin = self.schedule.num_pipelines == 2
        if twin:  # what earlier steps summed with the twin must be counted once
            share_summed_grads(self._twin_params, 2)
        output = self._run("train", self._executor, args, kwargs, target, losses, return_outputs, loss_kwargs)
        if twin:
            twins.sum_twin_gradients(self)
        return output

    def eval(self, *args, target: Optional[torch.Tensor] = None, losses: Optional[list] = None,
             return_outputs: bool = True, loss_kwargs: Optional[dict] = None, **kwargs) -> Optional[StageOutput]:
        """Runs the forward of one batch over the pipeline, without autograd: each rank's forward
        passes in the schedule's order (``Schedule.forward_only``), nothing kept for a backward,
        no gradient touched. Arguments and result as ``step``; without ``target`` the last
        stage computes no loss and only returns its outputs.
        """
        self._ensure_bound()
        return self._run_eval(args, kwargs, target, losses, return_outputs, loss_kwargs)

    def _run_eval(self, args, kwargs, target, losses, return_outputs, loss_kwargs) -> Optional[StageOutput]:
        if self._eval_executor is None:
            self._eval_executor = self._make_executor(self.schedule.forward_only().lowered(in_order=self.in_order_p2p))
        return self._run("eval", self._eval_executor, args, kwargs, target, losses, return_outputs, loss_kwargs)

    # A forward-only schedule class (torch's _ScheduleForwardOnly) sets this.
    _forward_only = False

    def _ensure_bound(self) -> None:
        """Binds a schedule given after construction (torch's custom schedules); see torch_names."""
        if self.schedule is None:
            self._bind(self._schedule_from_order())

    def _schedule_from_order(self) -> "S.Schedule":
        raise RuntimeError("torchpp pipeline: this schedule has no action lists; set pipeline_order (or load a CSV) "
                           "before step()")

    def _run(self, kind: str, executor, args, kwargs, target, losses, return_outputs,
             loss_kwargs) -> Optional[StageOutput]:
        """Splits the batch into microbatches and runs ``executor``'s step over them."""
        self._loss_kwargs = dict(loss_kwargs or {})
        if losses is not None and not isinstance(losses, list):
            raise TypeError(f"torchpp pipeline: losses must be a list, got {type(losses).__name__}")
        try:
            changed = self._prepare(kind, args, kwargs, target)
        except Exception as error:
            # The other ranks may already wait in this step: fail it on every rank, not just here.
            try:
                executor.abort_step(f"{type(error).__name__}: {error}")
            except PipelineError:
                pass  # what this rank raises is its own error, below
            raise
        try:
            executor.step(changed)
        finally:
            self._inputs = self._targets = self._arguments = None
        if self._script is not None:
            self._losses, self._outputs = self._script.losses(), self._script.outputs()
        mine = sorted(self._outputs)
        for st in self.stages:  # torch's stages keep the last step's outputs of a last stage
            st.has_backward = kind == "train"
            st.output_chunks[:] = [self._outputs[k] for k in mine] if st.is_last else []
        if losses is not None and self._has_last:
            losses.clear()
            losses.extend(self._losses[k] for k in sorted(self._losses))
        if not mine or not return_outputs:
            return None
        return merge_chunks([self._outputs[k] for k in mine], self.output_merge_spec)

    # ---- measurements ----
    @property
    def peak_activations(self) -> int:
        """Most microbatch-stages whose activations were alive at once on this rank, last step."""
        return self._executor.peak_activations

    def timeline(self) -> List[tuple]:
        """This rank's last step: ``(action, start_us, end_us, arrived_us)`` per action."""
        return self._executor.timeline()


# torch.distributed.pipelining.schedules also holds its schedule classes, its action vocabulary
# and its runtime's helpers; here they live in modules that import this one, reached by the same
# import (``from torchpp.pipeline.schedules import ScheduleGPipe, _Action, F``).
def __getattr__(name: str):
    if name.startswith("__"):  # import machinery probing a module attribute
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from torchpp.pipeline import actions, build, torch_internals, torch_names

    if name in _ACTION_NAMES:
        return getattr(actions, _ACTION_NAMES[name])
    for module in (torch_names, torch_internals, build):
        if hasattr(module, name):
            return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# torch's private names of the action vocabulary -> torchpp's.
_ACTION_NAMES = {"_Action": "Action", "_ComputationType": "ComputationType", **{
    n: n for n in ("F", "I", "W", "B", "FORWARD", "BACKWARD_INPUT", "BACKWARD_WEIGHT", "FULL_BACKWARD", "UNSHARD",
                   "RESHARD", "SEND_F", "RECV_F", "SEND_B", "RECV_B", "OVERLAP_F_B", "REDUCE_GRAD")}}
