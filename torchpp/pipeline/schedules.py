"""build_schedule and the PipelineSchedule it returns: the step() users call.

The order of work comes from the schedule compiler (torchpp.schedule); the C++ executor
(csrc/runtime) runs this rank's lowered action list and calls back here only to run a stage's
forward (and the loss on a last stage).
"""
from __future__ import annotations

import datetime
import hashlib
import os
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten

from torchpp import _C
from torchpp import schedule as S
from torchpp.pipeline import split_modules
from torchpp.pipeline.errors import PipelineError, PipelineTimeoutError
from torchpp.pipeline.microbatch import (chunk_dim_of, loss_weights, merge_chunks, split_args_kwargs_into_chunks,
                                         split_microbatches)
from torchpp.pipeline.stage import PipelineStage
from torchpp.pipeline.trace import parse_action
from torchpp.tensor_parallel.utils import combine_flat_grads, share_summed_grads

# Tag of the gradient exchange between DualPipe's twin stages, far above the executor's tags.
_TWIN_GRAD_TAG = 1 << 30

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


class PipelineSchedule:
    """A compiled schedule bound to this rank's stages; call ``step`` once per batch.

    Built by ``build_schedule``; see there for the arguments.
    """

    def __init__(self, schedule: "S.Schedule", stages: List[PipelineStage], loss_fn, scale_grads: bool,
                 scatter_gather: bool, in_order_p2p: Optional[bool] = None, *, args_chunk_spec=None,
                 kwargs_chunk_spec=None, output_merge_spec=None, grad_scaler=None, timeout=None,
                 overlap_forward_backward: bool = False, overlap_groups: Sequence[dist.ProcessGroup] = ()):
        self.schedule = schedule
        self.overlap_forward_backward = bool(overlap_forward_backward)
        self._overlap_groups = list(overlap_groups)
        self.timeout = timeout_seconds(timeout)
        self.args_chunk_spec = args_chunk_spec
        self.kwargs_chunk_spec = kwargs_chunk_spec
        self.output_merge_spec = output_merge_spec
        first = stages[0]
        # NCCL matches messages by order and may hold a send until its receive is posted.
        self.in_order_p2p = first.device.type != "cpu" if in_order_p2p is None else bool(in_order_p2p)
        self.lowered = schedule.lowered(in_order=self.in_order_p2p)
        self.loss_fn = loss_fn
        self.scale_grads = scale_grads
        self.grad_scaler = grad_scaler
        # Whether a loss is multiplied before its backward: by its microbatch's share, the loss scale, or both.
        self._weighted_seed = scale_grads or grad_scaler is not None
        self.num_microbatches = schedule.num_microbatches
        self.group = first.group
        self.rank = first.group_rank
        self.device = first.device
        self._stage_of = self._place(stages)
        self.stages = stages
        self._split_backward_layers()
        if schedule.num_pipelines == 2:
            self._twin_params = self._flag_twin_parameters()
        spp = schedule.num_stages // schedule.num_pipelines
        self._stages_per_pipeline = spp
        self._has_first = any(s % spp == 0 for s in self._stage_of)
        self._has_last = any(s % spp == spp - 1 for s in self._stage_of)
        self._tp_group = first.tp_group
        self._scatter_gather = bool(scatter_gather and self._tp_group is not None and self._tp_group.size() > 1)
        self._script = self._script_stages(loss_fn, self._weighted_seed, spp)
        self._executor = self._make_executor(self.lowered)
        self._eval_executor = None  # built by the first eval()
        self._signatures: Dict[str, tuple] = {}  # per executor: its last step's input shapes
        self._inputs: Optional[List[torch.Tensor]] = None
        self._arguments: Optional[List[tuple]] = None  # per microbatch: the first stage's (args, kwargs)
        self._targets: Optional[List[torch.Tensor]] = None
        self._weights: List[float] = []
        self._losses: Dict[int, torch.Tensor] = {}
        self._outputs: Dict[int, torch.Tensor] = {}
        self._loss_kwargs: dict = {}

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
        loss_ok = not self._has_last or loss_fn is None or isinstance(loss_fn, torch.jit.ScriptModule)
        if not (scripted and loss_ok):
            return None
        modules = {s: st.submod for s, st in self._stage_of.items()}
        return _C.ScriptStages(modules, loss_fn if self._has_last else None, spp, weighted_seed,
                               expected_outputs={s: st.output_tensors for s, st in self._stage_of.items()
                                                 if st.output_tensors and s % spp == spp - 1})

    @property
    def torchscript_stages(self) -> bool:
        """Whether this rank's stages (and loss) run as TorchScript from C++, without Python."""
        return self._script is not None

    # ---- the executor's callback ----
    def _forward(self, stage: int, microbatch: int, inputs: List[torch.Tensor]) -> StageOutput:
        spp = self._stages_per_pipeline
        module = self._stage_of[stage].submod
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
        if self.loss_fn is not None and self._targets is None:  # eval() without target: outputs only
            self._outputs[microbatch] = _detached(output)
            return output
        if self.loss_fn is None:
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
            losses: if a list, this rank's per-microbatch losses (unscaled) are appended.
            return_outputs: False returns None everywhere (the outputs are not concatenated).
            loss_kwargs: further keyword arguments of every microbatch's ``loss_fn`` call.

        Returns:
            On ranks holding a last stage, the outputs of its microbatches merged by the
            ``output_merge_spec`` (default: concatenated along dim 0, entry by entry if the
            last stage returns a tuple); None elsewhere.
        """
        if not torch.is_grad_enabled():
            raise RuntimeError("torchpp pipeline: step() runs a backward and cannot run under torch.no_grad(); "
                               "call eval() for a forward-only pass")
        twins = self.schedule.num_pipelines == 2
        if twins:  # what earlier steps summed with the twin must be counted once
            share_summed_grads(self._twin_params, 2)
        output = self._run("train", self._executor, args, kwargs, target, losses, return_outputs, loss_kwargs)
        if twins:
            self._sum_twin_gradients()
        return output

    def eval(self, *args, target: Optional[torch.Tensor] = None, losses: Optional[list] = None,
             return_outputs: bool = True, loss_kwargs: Optional[dict] = None, **kwargs) -> Optional[StageOutput]:
        """Runs the forward of one batch over the pipeline, without autograd: each rank's forward
        passes in the schedule's order (``Schedule.forward_only``), nothing kept for a backward,
        no gradient touched. Arguments and result as ``step``; without ``target`` the last
        stage computes no loss and only returns its outputs.
        """
        if self._eval_executor is None:
            self._eval_executor = self._make_executor(self.schedule.forward_only().lowered(in_order=self.in_order_p2p))
        return self._run("eval", self._eval_executor, args, kwargs, target, losses, return_outputs, loss_kwargs)

    def _run(self, kind: str, executor, args, kwargs, target, losses, return_outputs,
             loss_kwargs) -> Optional[StageOutput]:
        """Splits the batch into microbatches and runs ``executor``'s step over them."""
        self._loss_kwargs = dict(loss_kwargs or {})
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
        if losses is not None:
            losses.extend(self._losses[k] for k in sorted(self._losses))
        mine = sorted(self._outputs)
        if not mine or not return_outputs:
            return None
        return merge_chunks([self._outputs[k] for k in mine], self.output_merge_spec)

    def _prepare(self, kind: str, args, kwargs, target) -> bool:
        """Checks and splits this rank's step arguments; whether the input shapes changed since
        this executor's last step."""
        m = self.num_microbatches
        x = args[0] if args else None
        if kind == "train" and self._has_last and self.loss_fn is not None and target is None:
            raise ValueError(f"torchpp pipeline: rank {self.rank} holds a last stage and needs target=")
        if self._has_first and x is None:
            raise ValueError(f"torchpp pipeline: rank {self.rank} holds a first stage and needs the batch input")
        if self._script is not None and (len(args) > 1 or kwargs):
            raise TypeError("torchpp pipeline: TorchScript stages take the batch tensor alone; got "
                            f"{len(args) - 1} more positional and {sorted(kwargs)} keyword arguments")
        if self._script is not None and self._has_last and self._loss_kwargs:
            raise TypeError(f"torchpp pipeline: a TorchScript loss_fn takes (output, target) alone; got loss_kwargs "
                            f"{sorted(self._loss_kwargs)}")
        # The common case, one batch tensor split along dim 0, skips the pytree walks (a step's
        # fixed cost delays the whole pipeline when it is on the first stage).
        plain = (len(args) == 1 and not kwargs and isinstance(x, torch.Tensor) and self.args_chunk_spec is None
                 and self.kwargs_chunk_spec is None)
        if not self._has_first:
            self._inputs = self._arguments = None
            firsts = []
        elif plain:
            self._inputs = firsts = split_microbatches(x, m)
            self._arguments = [((), {}) for _ in range(m)]
        else:
            args_split, kwargs_split = split_args_kwargs_into_chunks(args, kwargs, m, self.args_chunk_spec,
                                                                     self.kwargs_chunk_spec)
            self._inputs = [a[0] for a in args_split]
            self._arguments = [(a[1:], k) for a, k in zip(args_split, kwargs_split)]
            if self._script is not None and not isinstance(x, torch.Tensor):
                raise TypeError(f"torchpp pipeline: TorchScript stages take a batch tensor, got {type(x).__name__}")
            firsts = [t for t in tree_flatten((self._inputs, self._arguments))[0] if isinstance(t, torch.Tensor)]
        self._targets = split_microbatches(target, m) if self._has_last and target is not None else None
        self._weights = self._seed_weights(kind, m)
        # Each executor caches the shapes its last step exchanged; compare against those.
        signature = tuple((tuple(t.shape), t.dtype) for t in firsts)
        changed = signature != self._signatures.get(kind)
        self._signatures[kind] = signature
        self._losses.clear()
        self._outputs.clear()
        if self._script is not None:
            self._script.set_step(self._inputs or [], self._targets or [], self._weights)
        return changed

    def _seed_weights(self, kind: str, m: int) -> List[float]:
        """Each microbatch's loss factor before backward: its share of the batch (scale_grads)
        times the grad scaler's current loss scale (fp16)."""
        weights = self._loss_weights(m) if self.scale_grads else [1.0] * m
        scaler = self.grad_scaler
        if kind != "train" or scaler is None or not scaler.is_enabled():
            return weights
        # scale() also puts the scaler's scale on this device, on every rank, before unscale_.
        loss_scale = float(scaler.scale(torch.ones((), device=self.device)))
        return [w * loss_scale for w in weights]

    def _loss_weights(self, m: int) -> List[float]:
        """Each microbatch's share of the batch: by the targets' sizes (split along dim 0, as
        torch does), else by the batch input's along its chunk dimension, else equal."""
        if self._targets is not None:
            return loss_weights(self._targets)
        dim = chunk_dim_of(self.args_chunk_spec[0]) if self.args_chunk_spec else 0
        if self._inputs is not None and dim is not None and isinstance(self._inputs[0], torch.Tensor):
            return loss_weights(self._inputs, dim)
        return [1.0 / m] * m

    def _flag_twin_parameters(self) -> List[torch.nn.Parameter]:
        """DualPipe: every parameter's gradient is summed with its twin's after backward
        (``grad_summed_after_backward``: data parallelism waits for it), and the gradient norm
        counts each parameter on the rank of its pipeline-0 copy (``shared_duplicate`` elsewhere;
        a parameter shared by two stages belongs to the earlier one). Returns the parameters
        once each, in model-stage order (the same order on the twin rank)."""
        unique: Dict[int, torch.nn.Parameter] = {}
        for st in sorted(self.stages, key=lambda s: s.stage_index):
            owned = self.schedule.stage_to_rank[st.stage_index] == self.rank  # pipeline 0's stage k is stage k
            for param in st.submod.parameters():
                if id(param) not in unique:
                    unique[id(param)] = param
                    param.grad_summed_after_backward = True
                    if not owned:
                        param.shared_duplicate = True
        return list(unique.values())

    def _sum_twin_gradients(self) -> None:
        """DualPipe: rank r and rank p-1-r both hold model stages r and p-1-r; add up their grads."""
        peer = dist.get_global_rank(self.group, self.schedule.num_ranks - 1 - self.rank)

        # Bounded where the wait blocks the host, as the executor's (zero: the group's own timeout).
        bounded = self.timeout > 0 and self.device.type == "cpu"
        bound = datetime.timedelta(seconds=self.timeout if bounded else 0)

        def add_twins(flat: torch.Tensor) -> torch.Tensor:
            theirs = torch.empty_like(flat)
            ops = [dist.P2POp(dist.isend, flat, peer, self.group, _TWIN_GRAD_TAG),
                   dist.P2POp(dist.irecv, theirs, peer, self.group, _TWIN_GRAD_TAG)]
            start = time.monotonic()
            try:
                for work in dist.batch_isend_irecv(ops):
                    work.wait(bound)
            except RuntimeError as error:
                waited = time.monotonic() - start
                if not bounded or waited < self.timeout:
                    raise
                raise PipelineTimeoutError(
                    f"torchpp pipeline: rank {self.rank} waited {waited:.1f} s for the gradients of its DualPipe "
                    f"twin (rank {self.schedule.num_ranks - 1 - self.rank}), the pipeline timeout: the peer is "
                    f"stopped, hung, or slower than the limit allows") from error
            return flat.add_(theirs)

        combine_flat_grads(self._twin_params, add_twins)

    # ---- measurements ----
    @property
    def peak_activations(self) -> int:
        """Most microbatch-stages whose activations were alive at once on this rank, last step."""
        return self._executor.peak_activations

    def timeline(self) -> List[tuple]:
        """This rank's last step: ``(action, start_us, end_us, arrived_us)`` per action."""
        return self._executor.timeline()


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
            microbatch (each microbatch's loss is weighted by its share of the batch).
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


# torch.distributed.pipelining.schedules holds its schedule classes and get_schedule_class;
# here they live in torch_names (which imports this module), reached by the same import.
_TORCH_NAMES = ("PipelineScheduleSingle", "PipelineScheduleMulti", "ScheduleGPipe", "Schedule1F1B",
                "ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble", "ScheduleLoopedBFS",
                "ScheduleZBVZeroBubble", "ScheduleDualPipeV", "get_schedule_class")


def __getattr__(name: str):
    if name in _TORCH_NAMES:
        from torchpp.pipeline import torch_names
        return getattr(torch_names, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
