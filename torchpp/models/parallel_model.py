"""The class a model takes under ``parallelize``: a subclass of its own class and of
``ParallelModule`` (any module) or ``ParallelCausalLM`` (a transformers causal LM,
torchpp.models.parallel_causal_lm), as FSDP2's fully_shard does, so isinstance, the forward and
the names stay; it adds ``step``, the gradients' completion and full state dicts."""
from __future__ import annotations

import functools
import inspect
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from torchpp import tensor_parallel as tp
from torchpp.parallel.groups import ParallelState


class ParallelMixin:
    """What ``parallelize`` adds to a model (its class becomes a subclass of its own class and
    this one, as FSDP2's fully_shard does, so isinstance, the forward and the names stay)."""

    parallel_state: ParallelState
    schedule = None
    pipeline_stages: Optional[List[nn.Module]] = None
    stage_indices: List[int]
    embedding_group: Optional[dist.ProcessGroup] = None
    loss_group: Optional[dist.ProcessGroup] = None
    grad_scaler = None
    weights_pending = False
    # (parameters, the group their gradients are summed over after backward), set by parallelize.
    _stage_shared: List[Tuple[List[nn.Parameter], dist.ProcessGroup]] = []

    @property
    def tp_group(self) -> dist.ProcessGroup:
        return self.parallel_state.tp_group

    @property
    def state(self) -> ParallelState:  # the name torchpp's other modules use
        return self.parallel_state

    @property
    def has_first_stage(self) -> bool:
        return 0 in self.stage_indices

    @property
    def has_last_stage(self) -> bool:
        return self._num_model_stages - 1 in self.stage_indices

    def _check_loaded(self) -> None:
        if self.weights_pending:
            raise RuntimeError("torchpp: the model was wrapped from the meta device and holds no weights yet; fill it "
                               "with torchpp.models.load_hf_weights(model, checkpoint) first")

    def _check_pipelined(self, call: str) -> None:
        if self.schedule is None:
            return
        raise RuntimeError(f"torchpp: a pipelined model (pp={self.parallel_state.pp}) holds only its stages; {call} "
                           f"runs through model.step(...) (forward + backward) or model.eval_step(...)")

    @property
    def tied_weight(self) -> Optional[nn.Parameter]:
        """This rank's copy of an embedding tied to the output layer on another stage (its
        gradient is summed across the two stages after backward), or None."""
        return getattr(self, "_tied_copy", None) if self.embedding_group is not None else None

    @property
    def stage_shared_parameters(self) -> List[nn.Parameter]:
        """This rank's parameters that other pipeline ranks hold too (a tied embedding, modules
        every stage runs), whose gradients ``finish_grads`` sums over them: a data-parallel
        reduction must wait for it (``DistributedOptimizer(hold=...)``)."""
        return [param for params, _ in self._stage_shared for param in params]

    def _share_summed_grads(self) -> None:
        # Gradients left by an earlier step were summed over the ranks holding them: count them once.
        for params, group in self._stage_shared:
            tp.share_summed_grads(params, group.size())

    def finish_grads(self) -> None:
        """Sums the gradients of parameters several pipeline ranks hold: a tied embedding's over
        the first and last stage, those of modules every stage runs over the pipeline (called by
        ``step``, which accumulates over several calls; after a custom backward call it yourself,
        once per optimizer step). Gradients of TP-replicated parameters are complete after every
        backward."""
        for params, group in self._stage_shared:
            for param in params:
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                dist.all_reduce(param.grad, group=group)

    @torch.no_grad()
    def full_state_dict(self, grads: bool = False) -> Dict[str, torch.Tensor]:
        """This rank's parameters (or their gradients) as the unsharded model's full tensors, by
        their names (a tied one under each of its names). Collective over the TP group (and the
        expert-parallel group, for expert parameters).

        Args:
            grads: return gradients (zeros where none) instead of values.
        """
        out: Dict[str, torch.Tensor] = {}
        group = self.tp_group
        gathered: Dict[int, torch.Tensor] = {}
        for name, param in self.named_parameters(remove_duplicate=False):
            if id(param) not in gathered:
                local = param.grad if grads else param
                local = torch.zeros_like(param) if local is None else local.detach().contiguous()
                layout = getattr(param, "tp_layout", None)
                if layout is not None and layout.dim is not None and group.size() > 1:
                    shards = [torch.empty_like(local) for _ in range(group.size())]
                    dist.all_gather(shards, local, group=group)
                    local = layout(shards)
                experts = getattr(param, "expert_parallel", None)  # (ep group, rank, size): whole experts
                if experts is not None and experts[2] > 1:
                    shards = [torch.empty_like(local) for _ in range(experts[2])]
                    dist.all_gather(shards, local, group=experts[0])
                    local = torch.cat(shards)
                gathered[id(param)] = local
            out[name] = gathered[id(param)]
        return out

    hf_state_dict = full_state_dict



@functools.lru_cache(maxsize=None)
def _takes_use_cache(cls: type) -> bool:
    return "use_cache" in inspect.signature(cls.forward).parameters


def sharded_call_inputs(args: tuple, kwargs: dict, keys: Tuple[str, ...], no_cache: bool = True) -> dict:
    """The batch a context-parallel model's call shards (``keys`` popped from ``kwargs``), its
    inputs checked: by keyword, and no key/value cache (``no_cache``: ask the model for none)."""
    if args:
        raise TypeError("torchpp: a context-parallel model takes its inputs by keyword (input_ids=..., labels=...)")
    if kwargs.get("use_cache"):
        raise ValueError("torchpp: a context-parallel model holds a shard of each sequence and keeps no key/value "
                         "cache; call it with use_cache=False (the default under cp)")
    if no_cache:
        kwargs["use_cache"] = False  # as training runs it: transformers then honours packed position ids too
    return {k: kwargs.pop(k, None) for k in keys}


class ParallelModule(ParallelMixin):
    """Any other module under ``parallelize``: its own forward (pp=1) plus ``step``. A transformers
    base model under cp runs on this rank's shard of the sequence and returns its shard of the
    hidden states (``torchpp.context_parallel.unshard_sequence`` gathers them)."""

    loss_fn = None

    def __call__(self, *args, **kwargs):
        self._check_pipelined("calling the model")
        cp = getattr(self, "context_parallel", None)
        if cp is None:
            return super().__call__(*args, **kwargs)
        from torchpp.context_parallel.hf import shard_batch

        batch = sharded_call_inputs(args, kwargs, ("input_ids", "inputs_embeds", "position_ids", "attention_mask"),
                                    no_cache=_takes_use_cache(type(self)))
        return super().__call__(**shard_batch(cp, **batch), **kwargs)

    def step(self, *args, target=None, losses: Optional[list] = None, **kwargs):
        """Forward and backward of one batch with ``parallelize``'s ``loss_fn(output, target)``;
        returns the loss (the last stage's, under a pipeline; None elsewhere)."""
        if self.loss_fn is None:
            raise ValueError("torchpp: step() needs parallelize(..., loss_fn=loss_fn(output, target))")
        if self.schedule is None:
            loss = self.loss_fn(super().__call__(*args, **kwargs), target)
            loss.backward()
            if losses is not None:
                losses.append(loss.detach())
            result = loss.detach()
        else:
            self._share_summed_grads()
            mine: list = []
            self.schedule.step(*args, target=target, losses=mine, return_outputs=False, **kwargs)
            if losses is not None:
                losses.extend(mine)
            result = None
            if mine:
                from torchpp.pipeline.microbatch import loss_weights, split_microbatches

                weights = loss_weights(split_microbatches(target, self.schedule.num_microbatches))
                computed_here = self.schedule.schedule.loss_microbatches(self.schedule.rank)
                result = sum(weights[k] * loss for k, loss in zip(computed_here, mine))
        self.finish_grads()
        return result



def swap_model_class(model: nn.Module, mixin: type) -> None:
    """Makes ``model`` an instance of a subclass of ``mixin`` and its own class."""
    cls = type(model)
    if issubclass(cls, ParallelMixin):
        raise ValueError(f"torchpp.parallelize: {cls.__name__} is parallelized already")
    model.__class__ = type(f"Parallel{cls.__name__}", (mixin, cls), {"__module__": cls.__module__})
