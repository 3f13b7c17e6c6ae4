"""``get_forward_backward_func``: Megatron-core's schedule function, run by torchpp's schedules.

Megatron's training loop calls ``get_forward_backward_func()(forward_step_func=...,
data_iterator=..., model=..., num_microbatches=..., seq_length=..., micro_batch_size=...)``
and gets the last stage's loss dicts back. The function returned here takes the same
arguments and returns the same list, but runs the step as any torchpp schedule (zb-h1, zb-h2,
zb-v, interleaved-1f1b, ...) on the C++ executor, with Megatron's TP linears split into I and
W passes. Gradients end where Megatron's schedule leaves them: DDP's ``main_grad`` buffers
reduced by ``config.finalize_model_grads_func``, or ``.grad`` for torchpp's optimizer.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from torchpp import schedule as S
from torchpp.models.megatron.ddp_hooks import fire_node_hooks_from_w
from torchpp.models.megatron.split_linears import route_split_bw
from torchpp.models.megatron.stages import MegatronPipeline, StepCall, check_chunk_counts

# Megatron features whose schedule-side behaviour torchpp's executor does not reproduce.
_UNSUPPORTED = {
    "num_microbatches_with_partial_activation_checkpoints": "partial activation checkpoints follow Megatron's "
    "1F1B window; use recompute_granularity",
    "defer_embedding_wgrad_compute": "the W passes already defer the output layer's weight gradient",
    "overlap_moe_expert_parallel_comm": "the combined 1F1B of MoE overlap is a schedule of its own",
    "hybrid_context_parallel": "hybrid context parallelism has a schedule of its own",
}


def _groups(pg_collection, p2p_communicator) -> Tuple[dist.ProcessGroup, dist.ProcessGroup, object]:
    """(pp, tp, ProcessGroupCollection) as Megatron's schedules find them."""
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    if pg_collection is None:
        pg_collection = ProcessGroupCollection()
        pg_collection.tp = parallel_state.get_tensor_model_parallel_group()
        pg_collection.cp = parallel_state.get_context_parallel_group()
        pg_collection.embd = parallel_state.get_embedding_group(check_initialized=False)
        pg_collection.pos_embd = parallel_state.get_position_embedding_group(check_initialized=False)
        pg_collection.pp = parallel_state.get_pipeline_model_parallel_group()
        pg_collection.dp_cp = parallel_state.get_data_parallel_group(with_context_parallel=True,
                                                                     partial_data_parallel=False)
    pp_group = p2p_communicator.pp_group if p2p_communicator is not None else pg_collection.pp
    return pp_group, pg_collection.tp, pg_collection


def _check_config(config, model: List[nn.Module]) -> None:
    from megatron.core.enums import ModelType
    from megatron.core.utils import get_model_type

    for name, why in _UNSUPPORTED.items():
        if getattr(config, name, None) not in (None, False):
            raise ValueError(f"torchpp.models.megatron: config.{name}={getattr(config, name)!r} is not supported "
                             f"({why})")
    if get_model_type(model[0]) == ModelType.encoder_and_decoder:
        raise ValueError("torchpp.models.megatron: encoder-and-decoder models are not supported")


def _sync_context(config, forward_only: bool) -> contextlib.AbstractContextManager:
    """Megatron's config.no_sync_func (one per chunk or one for all): DP waits for the step's end."""
    no_sync = config.no_sync_func
    if forward_only or no_sync is None:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    for func in no_sync if isinstance(no_sync, list) else [no_sync]:
        stack.enter_context(func())
    return stack


def _per_chunk(func, model: List[nn.Module]) -> List[Optional[Callable]]:
    return list(func) if isinstance(func, list) else [func] * len(model)


class ForwardBackwardFunc:
    """The function ``get_forward_backward_func`` returns (see there); call it as Megatron's."""

    def __init__(self, schedule: str, *, split_bw: bool = True, scatter_gather: Optional[bool] = None,
                 in_order_p2p: Optional[bool] = None, **generate_options):
        if not isinstance(schedule, str) or schedule not in S.SCHEDULES:
            raise ValueError(f"torchpp.models.megatron: unknown schedule {schedule!r}; one of {list(S.SCHEDULES)}")
        self.schedule = schedule
        self.split_bw = split_bw
        self.scatter_gather = scatter_gather
        self.in_order_p2p = in_order_p2p
        self.generate_options = generate_options
        self.pipeline: Optional[MegatronPipeline] = None  # the last step's
        self._pipelines: Dict[tuple, MegatronPipeline] = {}
        self._signatures: Dict[tuple, tuple] = {}

    def __repr__(self) -> str:
        return f"torchpp.models.megatron.get_forward_backward_func({self.schedule!r})"

    def _pipeline(self, model: List[nn.Module], config, num_microbatches: int, pp_group, tp_group) -> MegatronPipeline:
        key = (tuple(id(chunk) for chunk in model), num_microbatches, pp_group.group_name)
        pipeline = self._pipelines.get(key)
        if pipeline is not None:
            return pipeline
        device = next(iter(model[0].parameters())).device
        check_chunk_counts(model, pp_group, device)
        chunks = None if self.schedule == "dualpipe" else len(model)
        compiled = S.generate(self.schedule, num_ranks=pp_group.size(), num_microbatches=num_microbatches,
                              num_chunks=chunks, **self.generate_options)
        if self.split_bw:
            for chunk in model:
                route_split_bw(chunk)
                fire_node_hooks_from_w(chunk)
        # Scatter/gather sends 1/t of a message that every TP rank holds whole; sequence-parallel
        # activations differ per TP rank.
        scatter_gather = self.scatter_gather if self.scatter_gather is not None else not config.sequence_parallel
        if scatter_gather and config.sequence_parallel:
            raise ValueError("torchpp.models.megatron: scatter_gather=True needs activations replicated over TP, "
                             "which sequence parallelism splits; pass scatter_gather=False")
        pipeline = MegatronPipeline(compiled, model, config, pp_group, tp_group, scatter_gather, self.in_order_p2p)
        self._pipelines = {key: pipeline}  # one model at a time: the executor holds buffers
        return pipeline

    def __call__(self, *, forward_step_func, data_iterator, model, num_microbatches: int, seq_length: int,
                 micro_batch_size: int, decoder_seq_length: Optional[int] = None, forward_only: bool = False,
                 collect_non_loss_data: bool = False, first_val_step: Optional[bool] = None,
                 adjust_tensor_shapes_fn: Optional[Callable] = None, p2p_communicator=None, pg_collection=None,
                 force_all_reduce: Optional[bool] = False) -> list:
        from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining
        from megatron.core.utils import get_model_config

        del adjust_tensor_shapes_fn  # shapes travel with the messages whenever they change
        chunks = list(model) if isinstance(model, list) else [model]
        iterators = list(data_iterator) if isinstance(data_iterator, list) else [data_iterator] * len(chunks)
        if len(iterators) != len(chunks):
            raise ValueError(f"torchpp.models.megatron: {len(chunks)} model chunks need as many data iterators, "
                             f"got {len(iterators)}")
        if num_microbatches < 1:
            raise ValueError(f"torchpp.models.megatron: num_microbatches={num_microbatches} must be at least 1")
        pp_group, tp_group, pg_collection = _groups(pg_collection, p2p_communicator)
        if pp_group.size() == 1:  # no pipeline: nothing to schedule
            return forward_backward_no_pipelining(
                forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
                num_microbatches=num_microbatches, seq_length=seq_length, micro_batch_size=micro_batch_size,
                decoder_seq_length=decoder_seq_length, forward_only=forward_only,
                collect_non_loss_data=collect_non_loss_data, first_val_step=first_val_step,
                pg_collection=pg_collection, force_all_reduce=force_all_reduce)
        config = get_model_config(chunks[0])
        _check_config(config, chunks)
        if collect_non_loss_data and not forward_only:
            raise ValueError("torchpp.models.megatron: collect_non_loss_data=True collects outputs, not losses; "
                             "it needs forward_only=True")
        pipeline = self.pipeline = self._pipeline(chunks, config, num_microbatches, pp_group, tp_group)
        call = StepCall(forward_step_func, iterators, num_microbatches, forward_only, collect_non_loss_data,
                        first_val_step, pg_collection.cp.size())
        if config.timers is not None:
            config.timers("forward-backward", log_level=1).start(barrier=config.barrier_with_L1_time)
        if not forward_only and config.param_sync_func is not None:
            # Megatron gathers chunk 0's parameters before the call and the others' during it.
            for index, sync in enumerate(_per_chunk(config.param_sync_func, chunks)):
                if index > 0 and sync is not None:
                    sync(chunks[index].parameters())
        kind = "eval" if forward_only else "train"
        signature = (seq_length, micro_batch_size, decoder_seq_length)
        changed = config.variable_seq_lengths or self._signatures.get(kind) != signature
        self._signatures[kind] = signature
        with _sync_context(config, forward_only), (torch.no_grad() if forward_only else contextlib.nullcontext()):
            pipeline.run(call, changed)
        if not forward_only:
            self._finish_grads(config, chunks, call, pg_collection, force_all_reduce)
        if config.timers is not None:
            config.timers("forward-backward").stop()
        return call.store

    @staticmethod
    def _finish_grads(config, chunks: List[nn.Module], call: StepCall, pg_collection, force_all_reduce) -> None:
        """What Megatron's schedule does after the last backward: grad sync, then finalize."""
        if config.grad_sync_func is not None:
            for index, sync in enumerate(_per_chunk(config.grad_sync_func, chunks)):
                sync(chunks[index].parameters())
        else:
            for chunk in chunks:
                # Megatron's hooks launch overlapped reductions during the last microbatch; here
                # the whole step ran under no_sync, so they launch now (finish_grad_sync waits).
                ddp_config = getattr(chunk, "ddp_config", None)
                if ddp_config is not None and ddp_config.overlap_grad_reduce and hasattr(chunk, "start_grad_sync"):
                    chunk.start_grad_sync()
        if config.finalize_model_grads_func is not None:
            config.finalize_model_grads_func(
                chunks, call.total_num_tokens if config.calculate_per_token_loss else None,
                pg_collection=pg_collection, force_all_reduce=force_all_reduce)


def get_forward_backward_func(schedule: str = "zb-h1", **options) -> ForwardBackwardFunc:
    """Megatron-core's ``get_forward_backward_func()``, running any torchpp schedule.

    Swap ``from megatron.core.pipeline_parallel import get_forward_backward_func`` for
    ``from torchpp.models.megatron import get_forward_backward_func``: the returned function
    takes Megatron's arguments (``forward_step_func, data_iterator, model, num_microbatches,
    seq_length, micro_batch_size, decoder_seq_length=None, forward_only=False,
    collect_non_loss_data=False, first_val_step=None, ...``) and returns Megatron's result (the
    loss-reduced dicts of the last stage's microbatches; an empty list elsewhere).

    ``model`` is this rank's list of model chunks, one per stage the schedule places on the
    rank, in stage order (interleaved schedules: chunk c is stage c*p + r, as Megatron builds
    them; V shapes: r and 2p-1-r), with ``data_iterator`` one iterator per chunk. Megatron's
    ColumnParallelLinear/RowParallelLinear get split backward passes (weights untouched), so
    zero-bubble schedules run their weight gradients in W passes; Megatron's DDP hooks fire
    from W. Without pipeline parallelism Megatron's own no-pipelining function runs.

    Args:
        schedule: a name of ``torchpp.schedule.SCHEDULES`` (not "dualpipe", whose twin stage
            copies Megatron's chunks cannot express).
        **options: ``split_bw`` (default True; False keeps Megatron's linears, so W passes are
            empty), ``scatter_gather`` (default: on unless config.sequence_parallel),
            ``in_order_p2p``, and ``torchpp.schedule.generate``'s ``costs``, ``memory_limit``,
            ``microbatch_group_size``.

    Returns:
        A ForwardBackwardFunc; it compiles the schedule for a model and a microbatch count
        on first use and reuses it.
    """
    return ForwardBackwardFunc(schedule, **options)
