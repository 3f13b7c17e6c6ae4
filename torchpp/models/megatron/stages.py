"""Megatron model chunks as torchpp pipeline stages, run by the C++ executor.

Each chunk on this rank becomes one ``PipelineStage`` of the schedule; the executor calls back
here for every forward pass, which runs Megatron's own ``forward_step`` (``set_input_tensor``,
the user's ``forward_step_func``, the loss function and its division by the number of
microbatches), so a step does what Megatron's schedule does, in the torchpp schedule's order.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from torchpp import schedule as S
from torchpp.pipeline.schedules import OUTPUT_IS_LOSS, PipelineSchedule
from torchpp.pipeline.stage import PipelineStage
from torchpp.models.megatron.split_linears import te_backward_dw_modules


def unwrapped(chunk: nn.Module, attr: str) -> nn.Module:
    """The module inside Megatron's wrappers (DDP, Float16Module) that defines ``attr``."""
    from megatron.core.utils import get_attr_wrapped_model

    return get_attr_wrapped_model(chunk, attr, return_model_obj=True)


def _device_of(chunk: nn.Module) -> torch.device:
    param = next(iter(chunk.parameters()), None)
    return param.device if param is not None else torch.device("cpu")


def check_chunk_counts(model: List[nn.Module], pp_group: dist.ProcessGroup, device: torch.device) -> None:
    """Raises on every pipeline rank when the ranks pass different numbers of model chunks."""
    mine = torch.tensor([len(model)], dtype=torch.int64, device=device)
    counts = [torch.zeros_like(mine) for _ in range(pp_group.size())]
    dist.all_gather(counts, mine, group=pp_group)
    counts = [int(c) for c in counts]
    if len(set(counts)) != 1:
        raise ValueError(f"torchpp.models.megatron: the pipeline ranks pass different numbers of model chunks "
                         f"{counts} (by pipeline rank); each passes one chunk per stage it holds")


def place_chunks(schedule: "S.Schedule", model: List[nn.Module], pp_rank: int) -> Dict[int, int]:
    """Model stage -> chunk index for this rank: the rank's stages in ascending order, one
    chunk each (Megatron's interleaving puts chunk c at stage c*p + r; V shapes at r and
    2p-1-r). Checks each chunk's pre_process/post_process against its stage's place."""
    if schedule.num_pipelines != 1:
        raise ValueError(f"torchpp.models.megatron: schedule {schedule.name!r} runs two copies of each stage "
                         f"(DualPipe), which Megatron's model chunks cannot express; use dualpipe-v")
    stages = sorted(s for s, r in enumerate(schedule.stage_to_rank) if r == pp_rank)
    if len(stages) != len(model):
        raise ValueError(f"torchpp.models.megatron: schedule {schedule.name!r} places {len(stages)} model stage(s) "
                         f"{stages} on pipeline rank {pp_rank}, but model is a list of {len(model)} chunk(s); pass "
                         f"one chunk per stage")
    last = schedule.num_stages - 1
    for chunk_index, (stage, chunk) in enumerate(zip(stages, model)):
        for flag, wanted in (("pre_process", stage == 0), ("post_process", stage == last)):
            try:
                value = getattr(unwrapped(chunk, flag), flag)
            except RuntimeError:
                continue  # not a Megatron language model: nothing to check
            if bool(value) != wanted:
                raise ValueError(f"torchpp.models.megatron: schedule {schedule.name!r} runs model chunk "
                                 f"{chunk_index} of pipeline rank {pp_rank} as stage {stage} of {last + 1}, "
                                 f"which needs {flag}={wanted}, but the chunk has {flag}={value}")
    return {stage: index for index, stage in enumerate(stages)}


@dataclass
class StepCall:
    """One call's arguments and what it collects."""

    forward_step_func: Callable
    iterators: List
    num_microbatches: int
    forward_only: bool
    collect_non_loss_data: bool
    first_val_step: Optional[bool]
    cp_size: int
    store: List = field(default_factory=list)
    total_num_tokens: Optional[torch.Tensor] = None
    next_microbatch: Dict[int, int] = field(default_factory=dict)


class MegatronPipeline(PipelineSchedule):
    """A compiled torchpp schedule whose stages are this rank's Megatron model chunks.

    Args:
        schedule: the compiled schedule.
        model: this rank's chunks, in the order of its stages.
        config: the chunks' Megatron TransformerConfig.
        pp_group, tp_group: Megatron's pipeline and tensor-parallel groups.
        scatter_gather, in_order_p2p: as ``torchpp.pipeline.build_schedule``.
    """

    def __init__(self, schedule: "S.Schedule", model: List[nn.Module], config, pp_group: dist.ProcessGroup,
                 tp_group: Optional[dist.ProcessGroup], scatter_gather: bool, in_order_p2p: Optional[bool]):
        pp_rank = pp_group.rank()
        self.chunk_of_stage = place_chunks(schedule, model, pp_rank)
        self.model = list(model)
        self.config = config
        spp = schedule.num_stages
        stages = []
        for stage, index in self.chunk_of_stage.items():
            te_modules = te_backward_dw_modules(model[index])
            builder = _te_dw_builder(te_modules) if te_modules else None
            stages.append(PipelineStage(model[index], stage, spp, _device_of(model[index]), group=pp_group,
                                        dw_builder=builder, tp_group=tp_group))
        self._call: Optional[StepCall] = None
        super().__init__(schedule, stages, loss_fn=OUTPUT_IS_LOSS, scale_grads=False, scatter_gather=scatter_gather,
                         in_order_p2p=in_order_p2p)

    def run(self, call: StepCall, shapes_changed: bool) -> None:
        """Runs one step (``call.forward_only``: forward passes alone) over the executor."""
        if call.forward_only and self._eval_executor is None:
            self._eval_executor = self._make_executor(self.schedule.forward_only().lowered(in_order=self.in_order_p2p))
        executor = self._eval_executor if call.forward_only else self._executor
        call.next_microbatch = {index: 0 for index in self.chunk_of_stage.values()}
        call.total_num_tokens = torch.zeros([], dtype=torch.int, device=self.device)
        self._call = call
        try:
            executor.step(shapes_changed)
        finally:
            self._call = None

    # ---- the executor's callback ----
    def _forward(self, stage: int, microbatch: int, inputs: List[torch.Tensor]):
        from megatron.core.pipeline_parallel.schedules import check_first_val_step, forward_step

        call, config = self._call, self.config
        index = self.chunk_of_stage[stage]
        # forward_step_func reads the chunk's data iterator: microbatches must come in order.
        expected = call.next_microbatch[index]
        if microbatch != expected:
            raise RuntimeError(f"torchpp.models.megatron: schedule {self.schedule.name!r} runs microbatch "
                               f"{microbatch} of stage {stage} before microbatch {expected}; forward_step_func "
                               f"reads each chunk's data iterator in order")
        call.next_microbatch[index] = microbatch + 1
        if len(inputs) > 1:
            raise TypeError(f"torchpp.models.megatron: stage {stage} received {len(inputs)} tensors; Megatron's "
                            f"set_input_tensor takes one")
        is_last = stage == self.schedule.num_stages - 1
        output, num_tokens = forward_step(
            call.forward_step_func, call.iterators[index], self.model[index], call.num_microbatches,
            inputs[0] if inputs else None, call.store, config, call.cp_size, call.collect_non_loss_data,
            checkpoint_activations_microbatch=None,
            is_first_microbatch=check_first_val_step(call.first_val_step, call.forward_only, microbatch == 0),
            current_microbatch=microbatch, vp_stage=index if len(self.model) > 1 else None, is_last_stage=is_last)
        if not is_last:
            if not isinstance(output, torch.Tensor):
                raise TypeError(f"torchpp.models.megatron: stage {stage} returned a {type(output).__name__} for "
                                f"microbatch {microbatch}; a stage before the last passes one tensor on")
            dtype = config.pipeline_dtype
            # pipeline_dtype is the dtype activations (and their gradients) travel in.
            return output.to(dtype) if dtype is not None and output.dtype != dtype else output
        call.total_num_tokens += num_tokens.to(call.total_num_tokens.device)
        if call.forward_only:
            return output if isinstance(output, torch.Tensor) else torch.zeros((), device=self.device)
        if not isinstance(output, torch.Tensor) or output.numel() != 1:
            raise TypeError(f"torchpp.models.megatron: the loss of microbatch {microbatch} must be a one-element "
                            f"tensor (loss_func's first result), got {output!r}")
        # Megatron's backward_step scales the last stage's loss before its backward (fp16).
        return config.grad_scale_func(output) if config.grad_scale_func is not None else output


def _te_dw_builder(modules: List[nn.Module]) -> Callable[[], Callable[[], None]]:
    """torch's dw_builder over Transformer Engine layers: W calls each one's backward_dw()."""

    def run() -> None:
        for module in modules:
            module.backward_dw()

    return lambda: run
