"""Materialisation: a model built on the meta device gets storage for this rank's shards (its
buffers computed again by the model's own initialisation), everything moves to this rank's
device, and the TP gradient hooks go on the parameters' final storage."""
from __future__ import annotations

import torch
from torch import nn

from torchpp.models.passes.state import WrapState
from torchpp.tensor_parallel.sharding import install_grad_hooks


def apply_materialize(model: nn.Module, state: WrapState) -> nn.Module:
    """Materialises meta tensors (``state.weights_pending``: parameters still wait for
    ``load_hf_weights``), moves the model to ``state.parallel.device`` and installs the TP
    gradient hooks.

    Args:
        model: this rank's part of the model, changed in place.
        state: reads parallel and tp_context; fills weights_pending.
    """
    from torchpp.models.hf_checkpoint import materialize_meta

    device = state.parallel.device
    _rebuild_meta_buffers(model, device)  # what _init_weights does to meta parameters does nothing
    state.weights_pending = materialize_meta(model, device)
    model.to(device)
    install_grad_hooks(model, state.tp_context)  # on the parameters' final storage
    return model


def _rebuild_meta_buffers(model: nn.Module, device: torch.device) -> None:
    """Buffers a model built on the meta device left there (rotary frequencies, embedding
    scales: computed at construction, never saved): a transformers model's own initialisation
    (``_init_weights``) computes them again, as from_pretrained does."""
    init = getattr(model, "_init_weights", None)
    for name, module in model.named_modules():
        stale = [b for b, buffer in module.named_buffers(recurse=False) if buffer.is_meta]
        if not stale:
            continue
        if init is None:
            raise ValueError(f"torchpp.parallelize: buffers {stale} of {name} are on the meta device; build the model "
                             f"on the meta device but call parallelize outside that context")
        for b in stale:
            module._buffers[b] = torch.empty_like(module._buffers[b], device=device)
        for attr in ("original_inv_freq",):  # rotary modules keep a plain-tensor copy too
            if isinstance(getattr(module, attr, None), torch.Tensor) and getattr(module, attr).is_meta:
                setattr(module, attr, torch.empty_like(getattr(module, attr), device=device))
        with torch.no_grad():
            init(module)
