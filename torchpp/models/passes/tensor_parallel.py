"""Tensor and sequence parallelism: the TP plan's modules sharded in place (torchpp.tensor_parallel.plan),
attention told its local head counts, the family's fixups, and, with sequence parallelism, the
residual stream of this rank's layers held in sequence slices (Megatron-3)."""
from __future__ import annotations

from typing import Callable

from torch import nn

from torchpp.models.parallel_config import TensorOptions
from torchpp.models.passes.resolve import context_of
from torchpp.models.passes.state import WrapState
from torchpp.models.plans import text_config
from torchpp.models.placeholders import ElsewhereLayer
from torchpp.models.stages import get_submodule
from torchpp.tensor_parallel.plan import apply_sequence_parallel, apply_tp_plan
from torchpp.tensor_parallel.styles import TPContext


def apply_tp(model: nn.Module, state: WrapState, options: TensorOptions) -> nn.Module:
    """Applies ``state.tp_plan`` with ``state.tp_context`` (tp > 1), then sequence parallelism.

    Args:
        model: the model (this rank's stages of it), sharded in place.
        state: reads parallel, hf, tp_plan, tp_context, fixups, layout.
        options: sequence_parallel.
    """
    ps, ctx = state.parallel, state.tp_context
    if ps.tp == 1:
        return model
    where = context_of(ctx, state.layer_contexts)
    apply_tp_plan(model, state.tp_plan, ctx, strict=False, config=text_config(model), context_of=where)
    _local_kv_groups(model, where)
    if state.fixups is not None:
        state.fixups(model, ctx)
    if options.sequence_parallel:
        stack = get_submodule(model, state.layout.layers)
        held = [i for i in range(len(stack)) if not isinstance(stack[i], ElsewhereLayer)]
        # The stack's ends split and gather only where this rank holds the first and last layer.
        apply_sequence_parallel(stack, ctx, layers=held, first=0 in held, last=len(stack) - 1 in held)
    if state.hf and ps.cp == 1 and _attention_dropout(model):
        from torchpp.models.attention import wrap_attention

        wrap_attention(model, recompute_core=False)  # dropout of split heads draws from the per-rank stream
    return model


def _attention_dropout(model: nn.Module) -> bool:
    config = text_config(model)
    return any(float(getattr(config, key, 0.0) or 0.0) > 0 for key in ("attention_dropout", "attn_pdrop"))


def _local_kv_groups(model: nn.Module, context_of: Callable[[str], TPContext]) -> None:
    """Attention whose key/value heads are copied (tp exceeds them) holds one of them per rank
    for its num_heads / tp query heads: transformers' repeat_kv reads ``num_key_value_groups``."""
    for name, module in model.named_modules():
        if hasattr(module, "num_key_value_groups") and any(
                getattr(getattr(child, "weight", None), "tp_replicas", 1) > 1 for child in module.children()):
            ctx = context_of(name)
            module.num_key_value_groups = ctx.num_heads // ctx.size
