"""Activation recomputation: "full" checkpoints each layer of the stack; "selective" recomputes
a transformers model's attention function (the s x s scores and probabilities, Megatron-3)."""
from __future__ import annotations

import functools
from typing import Optional

from torch import nn

from torchpp.models.passes.state import WrapState
from torchpp.models.placeholders import ElsewhereLayer
from torchpp.models.stages import get_submodule


def apply_recompute(model: nn.Module, state: WrapState, mode: Optional[str]) -> nn.Module:
    """Recomputes this rank's layers ("full") or attention cores ("selective"); None: nothing.

    Args:
        model: the model, changed in place.
        state: reads layout and context (a context-parallel attention recomputes its own core).
        mode: None, "full" or "selective" (``apply_plans`` checked that the model allows it).
    """
    if mode == "selective":
        if state.context is not None:
            from torchpp.context_parallel.hf import apply_context_parallel

            apply_context_parallel(model, state.context, recompute_core=True,
                                   layers=state.layout.layers if state.layout is not None else None)
        else:
            from torchpp.models.attention import wrap_attention

            wrap_attention(model, recompute_core=True)
    elif mode == "full":
        from torchpp import recompute

        for layer in get_submodule(model, state.layout.layers):
            if not isinstance(layer, ElsewhereLayer):  # the hooks of its __call__ stay outside the recomputation
                layer.forward = functools.partial(recompute.checkpoint, layer.forward)
    return model
