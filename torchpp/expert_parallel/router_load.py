"""The MoE load-balancing loss under a pipeline: router statistics carried with the hidden states.

transformers' ``load_balancing_loss_func`` needs, over all MoE layers, each expert's number of
top-k assignments, the sum of each expert's router probability and the number of rows. Under a
pipeline no stage sees every layer, so each stage adds its layers' statistics to those it
received (hooks on the routers, the same ops as transformers in the same order) and hands them
on: an int64 [E + 1] tensor of counts (E histogram bins, then the rows: exact integers, which
travel forward only) and a float32 [E] tensor of probability sums (floating, so its gradient
travels back through the pipeline like the hidden states'). The last stage's loss sums both over
the data-parallel ranks and computes the microbatch's aux loss as transformers does
(``load_balancing_loss``).

Per microbatch: 1F1B-like schedules run microbatch 0's backward before the last microbatch's
forward, so the whole batch's aux loss (whose gradient needs every token's expert counts) cannot
be had; as Megatron and transformers' Trainer under gradient accumulation, each microbatch's loss
holds the aux loss of that microbatch over every data-parallel rank's rows.
"""
from __future__ import annotations

import contextlib
import threading
from typing import List, Optional, Tuple

import torch
from torch import nn

ROUTER_LOGITS = "router_logits"

# The accumulator of the stage running on this thread (None: nothing is accumulated, e.g. while
# a checkpointed layer is recomputed in backward, which must still run the same ops).
_running = threading.local()


class RouterLoad:
    """One microbatch's running router statistics on one stage; ``mask``: the microbatch's
    attention mask flattened to float32 [rows] (transformers then counts unmasked rows alone),
    or None."""

    def __init__(self, counts: torch.Tensor, prob_sum: torch.Tensor, top_k: int, mask: Optional[torch.Tensor] = None):
        self.counts, self.prob_sum, self.top_k, self.mask = counts, prob_sum, top_k, mask

    @property
    def num_experts(self) -> int:
        return self.prob_sum.numel()


def _current() -> Optional[RouterLoad]:
    return getattr(_running, "load", None)


@contextlib.contextmanager
def accumulating(load: RouterLoad):
    """Routers running on this thread inside the block add their statistics to ``load``."""
    previous = _current()
    _running.load = load
    try:
        yield load
    finally:
        _running.load = previous


def starting_load(num_experts: int, top_k: int, device) -> RouterLoad:
    """The first stage's statistics: nothing counted yet."""
    return RouterLoad(torch.zeros(num_experts + 1, dtype=torch.int64, device=device),
                      torch.zeros(num_experts, dtype=torch.float32, device=device), top_k)


class _MaskedRowSum(torch.autograd.Function):
    """(probs * mask[:, None]).sum(0), transformers' masked probability sum, with the mask kept
    on ctx rather than saved for backward: a checkpointed layer recomputed in backward (which
    knows no mask) then saves what its forward saved, and the backward still uses the mask."""

    @staticmethod
    def forward(ctx, probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        ctx.mask = mask
        return (probs * mask.unsqueeze(-1)).sum(dim=0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.unsqueeze(0) * ctx.mask.unsqueeze(-1), None


def layer_statistics(router_logits: torch.Tensor, num_experts: int, top_k: int,
                     mask: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor, object]:
    """(top-k assignments per expert [E] float32, router probability sums [E] float32, rows)
    of one layer's logits [rows, E]: load_balancing_loss_func's reductions, op for op (the
    masked ones where ``mask``, float32 [rows], is given)."""
    routing_weights = torch.nn.functional.softmax(router_logits, dim=-1)
    _, selected_experts = torch.topk(routing_weights, top_k, dim=-1)
    if mask is None:
        # transformers' choice: histc counts floats on CPU/MPS, ints elsewhere (determinism).
        histc_dtype = torch.float32 if router_logits.device.type in ("cpu", "mps") else torch.int32
        assigned = torch.histc(selected_experts.reshape(-1).to(histc_dtype), bins=num_experts, min=0,
                               max=num_experts)
        return assigned, routing_weights.float().sum(dim=0), routing_weights.shape[0]
    assigned = torch.zeros(num_experts, dtype=torch.float32, device=router_logits.device).scatter_add_(
        0, selected_experts.reshape(-1), mask.repeat_interleave(top_k))
    return assigned, _MaskedRowSum.apply(routing_weights.float(), mask), mask.sum()


def load_balancing_loss(counts: torch.Tensor, prob_sum: torch.Tensor) -> torch.Tensor:
    """transformers' load_balancing_loss_func from the summed statistics (counts int64 [E + 1]:
    assignments per expert, then rows; prob_sum float32 [E])."""
    num_experts = prob_sum.numel()
    total_rows = counts[num_experts].to(torch.float32)
    tokens_per_expert = counts[:num_experts].to(torch.float32) / total_rows
    router_prob_per_expert = prob_sum / total_rows
    overall_loss = torch.sum(tokens_per_expert * router_prob_per_expert.unsqueeze(0))
    return overall_loss * num_experts


def router_recorder(model: nn.Module):
    """The OutputRecorder transformers records ``router_logits`` from (the causal LM's or its
    base model's ``_can_record_outputs`` entry), or None."""
    recorder = (getattr(type(model), "_can_record_outputs", None) or {}).get(ROUTER_LOGITS)
    if recorder is None:
        for child in model.modules():
            recorder = (getattr(type(child), "_can_record_outputs", None) or {}).get(ROUTER_LOGITS)
            if recorder is not None:
                break
    return recorder


def aux_loss_shape(model: nn.Module) -> Optional[Tuple[int, int]]:
    """(number of experts, top-k) when ``model`` is a causal LM that adds transformers'
    load-balancing loss (Mixtral, Qwen2-MoE, Qwen3-MoE: ``num_experts``, ``num_experts_per_tok``,
    ``router_aux_loss_coef`` and recorded router logits), else None (DeepSeek-V3's adds none)."""
    experts, top_k = getattr(model, "num_experts", None), getattr(model, "num_experts_per_tok", None)
    if not isinstance(experts, int) or not isinstance(top_k, int) or not hasattr(model, "router_aux_loss_coef"):
        return None
    return (experts, top_k) if router_recorder(model) is not None else None


def record_router_load(model: nn.Module) -> List[object]:
    """Hooks the routers transformers records ``router_logits`` from so that each adds its
    layer's statistics to the running stage's ``RouterLoad``; returns the hook handles."""
    recorder = router_recorder(model)
    target, index = getattr(recorder, "target_class", None), getattr(recorder, "index", 0)
    layer_name = getattr(recorder, "layer_name", None)
    shape = aux_loss_shape(model)

    def hook(module, args, output):
        logits = output[index] if isinstance(output, tuple) else output
        load = _current()
        # Computed even with no stage running: a checkpointed layer recomputed in backward must
        # save the same tensors as its forward did.
        num_experts, top_k = (load.num_experts, load.top_k) if load is not None else shape
        mask = load.mask if load is not None else None
        if mask is not None and mask.numel() != logits.shape[0]:
            raise ValueError(f"torchpp: the attention_mask's {mask.numel()} tokens do not match the {logits.shape[0]} "
                             f"rows of {type(module).__name__}'s router logits")
        assigned, prob_sum, rows = layer_statistics(logits, num_experts, top_k, mask)
        if load is not None:
            # Exact integers (the masked ones too: sums of ones); an int row count joins as a
            # padded constant, a masked one (a tensor) without a host sync.
            if isinstance(rows, torch.Tensor):
                counted = torch.cat([assigned, rows.reshape(1)]).to(torch.int64)
            else:
                counted = torch.nn.functional.pad(assigned.to(torch.int64), (0, 1), value=rows)
            load.counts = load.counts + counted
            load.prob_sum = load.prob_sum + prob_sum
        return None

    handles = []
    for name, module in model.named_modules():
        if (target is not None and isinstance(module, target)) or (layer_name and name.endswith(layer_name)):
            handles.append(module.register_forward_hook(hook))
    return handles
