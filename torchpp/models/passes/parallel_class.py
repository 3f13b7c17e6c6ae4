"""The parallel class: the model becomes a ``ParallelCausalLM`` (a transformers causal LM) or a
``ParallelModule`` (any other), a subclass of its own class, holding what ``step`` and the
optimizer read (the parallel state, its stages, the loss, the scaler)."""
from __future__ import annotations

from torch import nn

from torchpp.models.parallel_causal_lm import ParallelCausalLM
from torchpp.models.parallel_config import ParallelConfig
from torchpp.models.parallel_model import ParallelModule, swap_model_class
from torchpp.models.passes.state import WrapState


def apply_parallel_class(model: nn.Module, state: WrapState, config: ParallelConfig) -> nn.Module:
    """Swaps the model's class and records ``state`` on it.

    Args:
        model: the model (its class changes in place).
        state: reads parallel, causal_lm, tp_context, placement, tied_names, context,
            ep_context, weights_pending.
        config: grad_scaler, loss_fn and tensor.vocab_parallel_logits.
    """
    swap_model_class(model, ParallelCausalLM if state.causal_lm else ParallelModule)
    model.parallel_state = state.parallel
    model._tp_context = state.tp_context
    model.weights_pending = state.weights_pending
    model.stage_indices = state.placement.mine
    model.tied_names = state.tied_names
    model._num_model_stages = state.placement.num_stages
    model.grad_scaler = config.grad_scaler
    if state.causal_lm:
        model.loss_shifts_labels = state.loss_shifts_labels
    model.parallel_plan = {"tp": dict(state.tp_plan), "pp": state.layout}  # what it followed (plan="auto": chose)
    if state.context is not None:
        object.__setattr__(model, "context_parallel", state.context)
    if state.ep_context is not None:
        model.ep_dropped = state.ep_context.dropped
    if not state.causal_lm:  # not a submodule, even when the loss is an nn.Module
        object.__setattr__(model, "loss_fn", config.loss_fn)
    if state.causal_lm and config.tensor.vocab_parallel_logits:
        head = model.get_output_embeddings()
        if getattr(head, "tp", None) is not None:
            head.tp.gather_output = False
        model.vocab_parallel_logits = True
        model.loss_function = model._vocab_parallel_loss
    return model
