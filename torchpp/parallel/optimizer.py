"""DistributedOptimizer: the data-parallel half of a training step in one object.

step() finishes the data-parallel gradient reduction (bucketed all-reduce that started during
backward, or ZeRO-1's reduce-scatter), unscales fp16 loss-scaled gradients, clips by the global
norm over dp x pp x tp, runs the wrapped torch.optim optimizer (or, with an inf or NaN on any
rank, skips it on every rank), and (ZeRO-1/2) all-gathers the updated parameters. ZeRO-2 and
ZeRO-3 reduce-scatter each gradient bucket during backward, as soon as it is final; ZeRO-3
gathers each bucket's parameters before the first forward that uses it. Without a loss
scaler the global norm is the inf/NaN check (torchpp/parallel/nonfinite.py): consecutive skips
end in NonFiniteGradientError naming the parameter and rank where the bad value appeared.
"""
from __future__ import annotations

from typing import Callable, Iterable, Optional, Union

import torch
import torch.distributed as dist

from torchpp.parallel.clip import (clip_coefficient, clip_grad_norm_, clip_grads_, global_grad_norm,
                                   expert_summed_squared_norm, norm_inputs)
from torchpp.parallel.data_parallel import DEFAULT_BUCKET_BYTES, GradReducer
from torchpp.parallel.grad_scaler import GradScaler
from torchpp.parallel.groups import ParallelState, get_parallel_state
from torchpp.parallel.nonfinite import DEFAULT_SKIP_LIMIT, SkipCounter, locate_nonfinite, parameter_names
from torchpp.parallel.post_validation import BackupBuffers, SpeculativeStep, current_options, restore_options
from torchpp.parallel.rank_memory import rank_memory_bytes
from torchpp.parallel.zero import ZeroRedundancyOptimizer
from torchpp.parallel.zero_grads import ShardedGradReducer
from torchpp.parallel.zero_params import gather_before_forward, zero_stage


class DistributedOptimizer:
    """A torch.optim optimizer over this rank's parameters, data parallel over ``state.dp_group``
    (with context parallelism, ``state.dp_cp_group``: gradients summed over cp, averaged over dp).

    Args:
        params: this rank's parameters (all its pipeline stages), or (name, parameter) pairs
            such as ``model.named_parameters()``: the non-finite guard's error names them; or
            the model itself (needed by zero=3, which hooks its modules' forwards).
        optimizer_class: e.g. torch.optim.AdamW.
        state: the ParallelState (default: get_parallel_state()).
        zero: the ZeRO stage over dp: 0 (or False) all-reduces gradients; 1 (or True) shards
            the optimizer state; 2 shards the gradients too (each bucket reduce-scattered as soon
            as backward finished it, its full gradient freed); 3 shards the parameters too
            (each bucket gathered before the first forward that uses it in a step, kept for
            the step's microbatches, released when its gradient is reduce-scattered).
            With 2 and 3, ``param.grad`` is None after backward: the shards are in the
            optimizer's param_groups; with 3, the model's parameters have no storage between
            steps (``gather_params()`` gathers them all, e.g. to evaluate or save).
            None: the stage given to ``parallelize(model, zero=...)`` (marked on its
            parameters), else 0.
        max_norm: clip gradients to this global norm (None: no clipping).
        accumulations_per_step: gradient accumulations per parameter per step (the number of
            microbatches), so buckets launch while backward runs.
        hold: parameters whose gradients change after backward (e.g. tied embeddings); with the
            model given, parameters used by two of its pipeline stages on this rank are added.
        bucket_bytes: data-parallel bucket size.
        grad_scaler: a torchpp.parallel.GradScaler (fp16): step() unscales the gradients
            before clipping, skips the update on every rank if any rank found an inf or NaN,
            and updates the scale. Give the same scaler to the pipeline schedule, which
            scales the losses' backward seeds.
        post_validate: update without waiting for the global norm (the zero-bubble paper's
            optimizer post-validation; needs max_norm): step() updates as if no clipping were
            needed while the norm's all-reduce runs, and the next step() (or flush()) checks
            it; if clipping was needed, the update is redone clipped and ``rerun`` is set: the
            batch just computed came from the speculative parameters and must run again.
            With a grad_scaler the inf/NaN check waits too: the update and the scale's update
            assume no overflow, and an overflow found later undoes the update (the skip),
            backs the scale off and sets ``rerun`` (and ``last_step_skipped``, which then
            describes the update that step() or flush() settled).
            Without a scaler, a non-finite norm found by flush() undoes the update the same way.
        skip_limit: without an (enabled) grad_scaler, a step whose global gradient norm is inf
            or NaN is skipped on every rank (``last_step_skipped``; the norm is computed, with
            one scalar all-reduce, even without max_norm); this many consecutive skips raise
            NonFiniteGradientError on every rank, naming the first parameter and global rank
            whose gradient held the inf or NaN. None: skip without ever raising. (With a
            scaler, skips back the loss scale off and never raise.)
        reshard_after_forward: zero=3: release each module's parameters after every forward
            and gather them again for its backward (one gather per module per forward and per
            backward, instead of one per bucket per step: less memory, more traffic).
        reduce_every_microbatch: zero=2|3 under gradient accumulation (microbatches): reduce-
            scatter a bucket whenever each of its parameters has a gradient since its last
            reduction, keeping only the shard across microbatches too (one reduce-scatter per
            bucket per microbatch instead of per step; see torchpp/parallel/zero_grads.py).
        **optimizer_kwargs: passed to optimizer_class (lr, weight_decay, ...).

    Call zero_grad() before a step's backward passes and step() after them.
    """

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        optimizer_class: Callable[..., torch.optim.Optimizer],
        state: Optional[ParallelState] = None,
        *,
        zero: Optional[Union[bool, int]] = None,
        max_norm: Optional[float] = None,
        accumulations_per_step: int = 1,
        hold: Iterable[torch.nn.Parameter] = (),
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        grad_scaler: Optional[GradScaler] = None,
        post_validate: bool = False,
        skip_limit: Optional[int] = DEFAULT_SKIP_LIMIT,
        reshard_after_forward: bool = False,
        reduce_every_microbatch: bool = False,
        **optimizer_kwargs,
    ):
        if grad_scaler is not None and not isinstance(grad_scaler, GradScaler):
            raise TypeError(f"DistributedOptimizer: grad_scaler must be a torchpp.parallel.GradScaler, got "
                            f"{type(grad_scaler).__module__}.{type(grad_scaler).__name__}: each rank sees only its "
                            f"own gradients, and a scaler that does not agree on inf/NaN over the ranks lets one "
                            f"rank skip a step the others take")
        if post_validate and max_norm is None:
            raise ValueError("DistributedOptimizer: post_validate=True validates clipping and needs max_norm")
        self.state = state or get_parallel_state()
        model = params if isinstance(params, torch.nn.Module) else None
        if model is not None:
            params = model.named_parameters()
        params = list(params)
        if zero is None:  # parallelize(model, zero=) marks the model and its parameters
            marked = [getattr(p, "zero_stage", None) for p in (item[-1] if isinstance(item, tuple) else item
                                                               for item in params)]
            zero = next((stage for stage in marked if stage is not None), 0)
        zero = zero_stage(zero)
        if reshard_after_forward and zero != 3:
            raise ValueError(f"DistributedOptimizer: reshard_after_forward=True reshards parameters, which only zero=3 "
                             f"shards; got zero={zero}")
        if reduce_every_microbatch and zero < 2:
            raise ValueError(f"DistributedOptimizer: reduce_every_microbatch=True reduce-scatters gradient shards, "
                             f"which zero=2 and zero=3 keep; got zero={zero}")
        if zero == 3 and model is None:
            raise ValueError("DistributedOptimizer: zero=3 gathers parameters before each module's forward and needs "
                             "the model: pass it as params (DistributedOptimizer(model, ...)), not its parameters")
        hold = list(hold) + _shared_by_stages(model)
        named = [item if isinstance(item, tuple) else (None, item) for item in params]
        named = [(name, p) for name, p in named if p.requires_grad]
        self.params = [p for _, p in named]
        self._names = parameter_names(self.params, [name for name, _ in named])
        self._skips = SkipCounter(skip_limit)
        self.max_norm = max_norm
        self.zero = zero
        # Over dp x cp (Megatron's dp-cp group): summed over cp, averaged over dp.
        reduce_group = self.state.dp_cp_group or self.state.dp_group
        # Expert parameters (expert parallelism) differ over the ep group: their gradients are summed
        # over the ranks holding the same experts only, and averaged over dp like the others.
        experts = [p for p in self.params if getattr(p, "expert_parallel", None) is not None]
        if experts and zero >= 2:
            raise NotImplementedError(f"DistributedOptimizer: zero={zero} with expert parallelism is not supported yet "
                                      f"(expert parameters are sharded under zero=1 only)")
        self.expert_reducer = None
        if experts and not zero:
            self.expert_reducer = GradReducer(experts, self.state.expert_dp_group, bucket_bytes, accumulations_per_step,
                                              hold, average_over=self.state.dp)
        dense = [p for p in self.params if getattr(p, "expert_parallel", None) is None]
        if zero == 1:
            self.optimizer = ZeroRedundancyOptimizer(self.params, optimizer_class, reduce_group,
                                                     average_over=self.state.dp,
                                                     expert_dp_group=self.state.expert_dp_group if experts else None,
                                                     **optimizer_kwargs)
            self.reducer = None
        elif zero >= 2:
            self.optimizer = ZeroRedundancyOptimizer(self.params, optimizer_class, reduce_group,
                                                     average_over=self.state.dp, bucket_bytes=bucket_bytes,
                                                     shard_params=zero == 3, **optimizer_kwargs)
            self.reducer = ShardedGradReducer(self.optimizer, accumulations_per_step, hold,
                                              every_microbatch=reduce_every_microbatch)
            if zero == 3:
                self._gather_hooks = gather_before_forward(model, self.optimizer, reshard_after_forward)
        else:
            self.optimizer = optimizer_class(self.params, **optimizer_kwargs)
            self.reducer = GradReducer(dense, reduce_group, bucket_bytes, accumulations_per_step, hold,
                                       average_over=self.state.dp)
        self.param_groups = self.optimizer.param_groups
        self.grad_scaler = grad_scaler
        self.last_grad_norm: Optional[torch.Tensor] = None
        self.last_step_skipped = False
        self.post_validate = post_validate
        self.rerun = False  # post_validate: the last step() rolled back its predecessor; run the batch again
        self.redone_steps = 0  # post_validate: updates redone clipped so far
        self._speculative: Optional[SpeculativeStep] = None
        self._backups = BackupBuffers()

    @property
    def torch_optimizer(self) -> torch.optim.Optimizer:
        """The torch.optim optimizer whose param_groups hold what is updated (ZeRO: the shards):
        the one to give an LR scheduler."""
        return self.optimizer.optimizer if self.zero else self.optimizer

    @property
    def _expert_norm_group(self) -> Optional[dist.ProcessGroup]:
        # Without ZeRO the norm sums over pp x tp, so experts' squares are summed over ep first;
        # ZeRO's sum runs over the world, where each expert shard is held once already.
        return None if self.zero else self.state.ep_group

    def _active_scaler(self) -> Optional[GradScaler]:
        return self.grad_scaler if self.grad_scaler is not None and self.grad_scaler.is_enabled() else None

    @property
    def consecutive_skips(self) -> int:
        """Steps skipped in a row for a non-finite gradient norm (no grad scaler), up to now."""
        return self._skips.consecutive

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for a non-finite gradient norm (no grad scaler) since construction."""
        return self._skips.total

    def _locate(self, pairs, group, norm):
        # Without ZeRO the norm spans one replica; the data-parallel group makes the report the run's.
        dp_group = None if self.zero else self.state.dp_group
        return locate_nonfinite(pairs, self._names, [group, dp_group], norm)

    def zero_grad(self) -> None:
        (self.reducer if self.reducer is not None else self.optimizer).zero_grad()
        if self.expert_reducer is not None:
            self.expert_reducer.zero_grad()

    def gather_params(self) -> None:
        """ZeRO-3: gathers all of this rank's parameters (collective over dp); the next step
        releases them again. No-op for the other stages."""
        if self.zero == 3:
            self.optimizer.gather_all_params()

    def memory_bytes(self) -> dict:
        """Bytes this rank holds now for parameters, gradients (full and sharded) and optimizer
        state, each storage counted once."""
        return rank_memory_bytes(self.params, self.optimizer if self.zero else None, self.torch_optimizer)

    def step(self) -> Optional[torch.Tensor]:
        """Reduces gradients over dp, unscales, clips, updates; returns the global gradient norm
        (with a grad scaler, only when clipping). A norm that is not finite means the update was
        skipped on every rank (see last_step_skipped and skip_limit)."""
        if self.reducer is None:
            self.optimizer.reduce_scatter_grads()
        else:
            self.reducer.finish()
        if self.expert_reducer is not None:
            self.expert_reducer.finish()
        if self.post_validate:
            return self._speculative_step()
        scaler = self._active_scaler()
        step_kwargs = {"grads_reduced": True} if self.zero else {}
        if scaler is not None:
            scaler.unscale_(self.optimizer)  # ZeRO's param_groups hold this rank's gradient shards
            norm = None
            if self.max_norm is not None:
                norm = clip_grad_norm_(self.params, self.max_norm, state=self.state,
                                       zero_optimizer=self.optimizer if self.zero else None)
            scaler.step(self.optimizer, **step_kwargs)  # skipped on every rank alike
            self.last_step_skipped = scaler.found_inf(self.optimizer)
            scaler.update()
            self.last_grad_norm = norm
            return norm
        pairs, group = norm_inputs(self.params, self.state, self.optimizer if self.zero else None)
        norm = global_grad_norm(pairs, self.state.tp_rank, group, self._expert_norm_group)  # one verdict for all ranks
        self.last_grad_norm = norm
        self.last_step_skipped = not bool(torch.isfinite(norm))
        if self.last_step_skipped:  # nothing updated, nothing gathered (ZeRO): every rank keeps its parameters
            self._skips.skipped(self._locate(pairs, group, norm))
            return norm
        if self.max_norm is not None:
            clip_grads_([grad for grad, _ in pairs], norm, self.max_norm)
        self.optimizer.step(**step_kwargs)
        self._skips.passed()
        return norm

    def _speculative_step(self) -> Optional[torch.Tensor]:
        """post_validate: settles the previous update, then updates unclipped while this step's
        norm is all-reduced in the background; returns the previous step's global norm."""
        self.rerun = self.flush()
        if self.rerun:  # this batch's gradients came from parameters that were just rolled back
            return self.last_grad_norm
        scaler = self._active_scaler()
        found_inf = scaler.unscale_locally_(self.optimizer) if scaler is not None else None  # agreed in flush()
        pairs, group = norm_inputs(self.params, self.state, self.optimizer if self.zero else None)
        squares = expert_summed_squared_norm(pairs, self.state.tp_rank, self._expert_norm_group)
        self._speculative = SpeculativeStep(self.torch_optimizer, squares, group, self._backups, scaler, found_inf)
        # Unclipped equals clipped whenever the clip coefficient is 1, which flush() checks.
        self.optimizer.step(**({"grads_reduced": True} if self.zero else {}))
        if scaler is not None:
            scaler.update_from(torch.zeros((), dtype=torch.float32))  # no overflow, as flush() checks
        return self.last_grad_norm

    def flush(self) -> bool:
        """post_validate: checks the pending speculative update against the global norm and the
        inf/NaN check (waiting for their all-reduces); if it should have been clipped, redoes it
        clipped, and if it should have been skipped (an overflow under the grad scaler, which
        then backs off; without one, a non-finite norm, counted against skip_limit), undoes it.
        Call it before evaluating, saving or stopping. Returns whether the update was redone or
        undone."""
        pending, self._speculative = self._speculative, None
        if pending is None:
            return False
        norm = pending.global_norm()
        self.last_grad_norm = norm
        self.last_step_skipped = pending.found_inf()
        if self.last_step_skipped:  # the synchronous step would have skipped the update
            pending.restore_grads(pending.rewind(self.torch_optimizer))
            if self.zero:
                self.optimizer.all_gather_params()  # the other shards' rewound values
            pending.back_off_scale()
            return True
        if pending.grad_scaler is None and not bool(torch.isfinite(norm)):  # the non-finite guard's skip
            current_grads = pending.rewind(self.torch_optimizer)  # the skipped step's gradients are back
            pairs, group = norm_inputs(self.params, self.state, self.optimizer if self.zero else None)
            report = self._locate(pairs, group, norm)
            pending.restore_grads(current_grads)
            if self.zero:
                self.optimizer.all_gather_params()
            self.last_step_skipped = True
            self._skips.skipped(report)
            return True
        self._skips.passed()
        if clip_coefficient(norm, self.max_norm).item() == 1.0:
            return False
        optimizer = self.torch_optimizer
        options = current_options(optimizer)  # an LR scheduler may have moved them since the update
        current_grads = pending.rewind(optimizer, keep_options=False)
        clip_grads_([t.grad for t in pending.tensors], norm, self.max_norm)
        self.optimizer.step(**({"grads_reduced": True} if self.zero else {}))  # with the update's own lr
        restore_options(optimizer, options)
        pending.restore_grads(current_grads)
        self.redone_steps += 1
        return True

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self.optimizer.load_state_dict(state_dict)


def _shared_by_stages(model) -> list:
    """Parameters that two of this rank's pipeline stages use (a tied embedding when one rank
    holds both the first and the last stage, as under zb-v): accumulated once per microbatch in
    each stage, so counting cannot tell when they are final; they wait for step()."""
    stages = getattr(model, "pipeline_stages", None) or []
    seen, shared = set(), []
    for stage in stages:
        for param in {id(p): p for p in stage.parameters()}.values():
            if id(param) in seen:
                shared.append(param)
            seen.add(id(param))
    return shared
