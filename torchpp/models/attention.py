"""torchpp's wrapper around a transformers model's own attention function.

transformers looks its attention function up by name (``config._attn_implementation``) in
``AttentionInterface``. Wrapping a model registers ``torchpp_<name>``, which calls the model's
own function (``sdpa``, ``flex_attention``, ..., or for ``eager`` the modeling module's
``eager_attention_forward``) and adds what parallelism needs around it:

- selective recompute (Megatron-3): the attention core, which holds the O(s^2) scores and
  probabilities, is recomputed in backward instead of kept;
- attention dropout on heads split over TP ranks draws from the per-TP-rank RNG stream (each
  rank holds different heads, so their masks must differ).

Masks keep the inner implementation's format (``AttentionMaskInterface`` gets the same name).
"""
from __future__ import annotations

import contextlib
import sys
from typing import Callable

from torch import nn

from torchpp import recompute
from torchpp.tensor_parallel.random import get_rng_tracker

PREFIX = "torchpp_"


def _inner_function(module: nn.Module, inner: str) -> Callable:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if inner == "eager" or inner not in ALL_ATTENTION_FUNCTIONS:
        eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        if eager is None:
            raise ValueError(f"torchpp: {type(module).__name__} has no eager_attention_forward to wrap")
        return eager
    return ALL_ATTENTION_FUNCTIONS[inner]


def _heads_split(module: nn.Module) -> bool:
    """Whether a TP style split this attention module's heads over TP ranks."""
    return any(getattr(getattr(child, "tp", None), "column", False) and not child.tp.gather_output
               for child in module.children())


def _wrapper(inner: str, recompute_core: bool) -> Callable:
    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        function = _inner_function(module, inner)
        dropout = kwargs.get("dropout", 0.0)
        fork = get_rng_tracker().fork() if dropout and _heads_split(module) else contextlib.nullcontext()
        with fork:
            if recompute_core:
                return recompute.checkpoint(function, module, query, key, value, attention_mask, *args, **kwargs)
            return function(module, query, key, value, attention_mask, *args, **kwargs)

    return attention


def _register(inner: str, recompute_core: bool) -> str:
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = f"{PREFIX}{'recompute_' if recompute_core else ''}{inner}"
    if name not in ALL_ATTENTION_FUNCTIONS:
        ALL_ATTENTION_FUNCTIONS.register(name, _wrapper(inner, recompute_core))
        mask = ALL_MASK_ATTENTION_FUNCTIONS[inner] if inner in ALL_MASK_ATTENTION_FUNCTIONS else \
            ALL_MASK_ATTENTION_FUNCTIONS["eager"]
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, mask)
    return name


def wrap_attention(model: nn.Module, recompute_core: bool) -> None:
    """Routes every attention call of a transformers ``model`` through torchpp's wrapper.

    Args:
        model: the model (its configs' attention implementation is renamed in place).
        recompute_core: recompute the attention core in backward (selective recompute).
    """
    configs = {id(c): c for c in [model.config] + [getattr(m, "config", None) for m in model.modules()]
               if c is not None and hasattr(c, "_attn_implementation")}
    for config in configs.values():
        inner = config._attn_implementation or "eager"
        if inner.startswith(PREFIX):
            if not recompute_core or inner.startswith(PREFIX + "recompute_"):
                continue  # wrapped already as asked
            inner = inner[len(PREFIX):]  # wrapped for TP dropout alone: recompute it too
        config._attn_implementation = _register(inner, recompute_core)
