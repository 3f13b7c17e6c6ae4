"""Placeholders that stand in, on one pipeline rank, for the modules other ranks hold.

A model cut into pipeline stages keeps its structure and parameter names on every rank: a layer
held elsewhere becomes an ``ElsewhereLayer`` (it passes its input through), a module before or
after the stack an ``Elsewhere`` (before: zeros of the module's output shape; after: never run).
"""
from __future__ import annotations

import copy
from typing import Optional

import torch
from torch import nn


class ElsewhereLayer(nn.Module):
    """Stands in for a layer held by another pipeline rank; passes its input through, but the one
    before a later stage's first layer returns the hidden states that stage received (which also
    enter its first layer: a pre-hook swaps them in). Where the model's
    layers return more than the hidden states (``(hidden, topk_indices)``, which the model
    hands to the next layer), it returns those ``extras`` too: what the previous stage's last
    layer returned, set by the stage running the model's forward."""

    placeholder = True  # plans skip it
    extras: Optional[tuple] = None
    # The layer before a later stage's first returns the hidden states that stage received: what the
    # model's forward computes from them between the layers (Inkling 2's block states) is then right.
    received: Optional[torch.Tensor] = None  # not "output": models read their layers' (X-MOD)

    def __init__(self, index: int, layer: Optional[nn.Module] = None, like: Optional[nn.Module] = None):
        super().__init__()
        self.index = index
        # The model may read its layers' plain attributes (an attention type per layer): keep them.
        for name, value in vars(layer or nn.Module()).items():
            if not name.startswith("_") and name != "training" and isinstance(value, (str, int, float, bool)):
                setattr(self, name, value)
        # Anything else it reads (a class attribute, X-MOD's layer[0].output.adapter_modules) comes from
        # ``like``: the layer itself where this rank holds it, else its copy on the meta device (no memory).
        object.__setattr__(self, "_like", like)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            like = self.__dict__.get("_like")
            if like is None or name.startswith("_"):
                raise
            return getattr(like, name)

    def forward(self, *args, **kwargs):
        hidden = self.received if self.received is not None else \
            args[0] if args else kwargs.get("hidden_states", next(iter(kwargs.values())))
        return hidden if self.extras is None else (hidden, *self.extras)

    def extra_repr(self) -> str:
        return f"layer {self.index} is on another pipeline rank"


class Elsewhere(nn.Module):
    """Stands in for a module (embedding, final norm, head) held by another pipeline rank.

    One that runs before the layers (``before``) still gets called by a later stage's run of
    the model's forward, whose result up to the stage's first layer is thrown away: it
    returns zeros shaped as the module's output (a copy of the module on the meta device,
    not registered, computes the shapes), so what the forward does with it (masks built from
    the embeddings' shape, scaling) runs as on the first stage. One after the layers is never
    reached."""

    placeholder = True  # plans skip it

    def __init__(self, path: str, before: bool, module: Optional[nn.Module] = None):
        super().__init__()
        self.path, self.before = path, before
        object.__setattr__(self, "_shape_of", meta_copy(module) if before and module is not None else None)
        # The model may read the module's own tensors (``embed_tokens.weight.device``): their shape, dtype, device.
        held = {} if module is None else {**dict(module.named_parameters(recurse=False)),
                                          **dict(module.named_buffers(recurse=False))}
        object.__setattr__(self, "_held", {name: (t.shape, t.dtype, t.device) for name, t in held.items()})

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            held = self.__dict__.get("_held", {})
            if name not in held:
                raise
            shape, dtype, device = held[name]
            return torch.zeros((), dtype=dtype, device=device).expand(shape)  # no memory: one zero, broadcast

    def forward(self, *args, **kwargs):
        if not self.before:
            raise RuntimeError(f"torchpp pipeline: {self.path} is held by another pipeline rank and cannot run here")
        like = next((t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)), None)
        device = None if like is None else like.device
        if self._shape_of is not None:
            to_meta = lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t  # noqa: E731
            with torch.no_grad():
                shapes = self._shape_of(*map(to_meta, args), **{k: to_meta(v) for k, v in kwargs.items()})
            return _zeros_like_tree(shapes, device)
        dtype = torch.get_default_dtype() if like is None or not like.is_floating_point() else like.dtype
        return torch.zeros((), dtype=dtype, device=device)

    def extra_repr(self) -> str:
        return f"{self.path} is on another pipeline rank"


def meta_copy(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose parameters and buffers live on the meta device (no memory)."""
    memo = {id(t): (nn.Parameter(torch.empty_like(t, device="meta"), requires_grad=t.requires_grad)
                    if isinstance(t, nn.Parameter) else torch.empty_like(t, device="meta"))
            for t in list(module.parameters()) + list(module.buffers())}
    return copy.deepcopy(module, memo)


def _zeros_like_tree(value, device):
    if isinstance(value, torch.Tensor):
        return torch.zeros(value.shape, dtype=value.dtype, device=device)
    if isinstance(value, (tuple, list)):
        return type(value)(_zeros_like_tree(v, device) for v in value)
    return value
