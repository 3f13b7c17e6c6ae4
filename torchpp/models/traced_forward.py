"""The traced forwards that read a model's structure (stack, run order, auto plan, splits, the
loss convention): one home for how they call the unwrapped model.

A trace runs the model in training mode on a few token ids, with autograd (the walks back read
its graph), restoring the random streams it draws from (dropout: the training draws the same
numbers as without the trace) and leaving no autograd history on the modules (RecurrentGemma's
recurrent state would otherwise reach the unsplit weights' graph from the next forward).
"""
from __future__ import annotations

import contextlib
import math
from typing import List, Optional

import torch
from torch import nn

from torchpp.models.plans import text_config
from torchpp.tensor_parallel.random import rng_restored
from torchpp.tensor_parallel.sharding import PlanError

# Tokens of a traced forward, unless the model fixes its sequence length (``trace_tokens``).
TRACE_TOKENS = 8


def model_device(model: nn.Module) -> torch.device:
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def trace_tokens(model: nn.Module) -> int:
    """``TRACE_TOKENS``, or the one length a model trains on: axial position embeddings
    (Reformer's) factor exactly the training sequence length."""
    config = text_config(model)
    axial = getattr(config, "axial_pos_shape", None)
    if axial and getattr(config, "axial_pos_embds", True):
        return math.prod(axial)
    return TRACE_TOKENS


def trace_ids(model: nn.Module) -> torch.Tensor:
    """Token ids ``[1, trace_tokens]`` of a trace, below the model's vocabulary."""
    vocab = getattr(text_config(model), "vocab_size", None) or 2
    return (torch.arange(trace_tokens(model), device=model_device(model)) % vocab).unsqueeze(0)


def traced_forward(model: nn.Module, ids: Optional[torch.Tensor] = None, *, grad: bool = True, **inputs):
    """``model(input_ids=ids, use_cache=False, **inputs)`` as a trace (the module docstring):
    the caller's hooks see it; the model is left as it was.

    Args:
        model: the unwrapped model.
        ids: the token ids (default: ``trace_ids(model)``).
        grad: with autograd (the walks back need it), else under no_grad.
        inputs: further model inputs (``labels``).
    """
    device = model_device(model)
    ids = trace_ids(model) if ids is None else ids
    with torch.set_grad_enabled(grad), leaving_no_history(model), rng_restored(device):
        return model(input_ids=ids, use_cache=False, **inputs)


def untracked_layers_error(model: nn.Module, stack: str, untracked: List[int], needs: str) -> PlanError:
    """The refusal for layers a trace saw run with autograd off (Reformer's reversible layers run
    inside a custom autograd function that recomputes them in its backward): ``needs`` says what
    reads their autograd graph."""
    return PlanError(f"torchpp.parallelize: {len(untracked)} layers of {stack} (the first: {stack}.{untracked[0]}) run "
                     f"without autograd inside {type(model).__name__}'s forward (a custom autograd function that "
                     f"computes their gradients itself, as reversible layers do): {needs}")


@contextlib.contextmanager
def leaving_no_history(model: nn.Module):
    """Around a traced forward: tensors with autograd history that the forward leaves on modules
    (RecurrentGemma's recurrent state) are put back as they were, or removed; else the next
    forward, once the model is split, could reach the trace's graph of the unsplit weights."""
    before = [(module, dict(vars(module))) for module in model.modules()]
    try:
        yield
    finally:
        for module, saved in before:
            for key, value in list(vars(module).items()):
                if isinstance(value, torch.Tensor) and value.grad_fn is not None and value is not saved.get(key):
                    if key in saved:
                        setattr(module, key, saved[key])
                    else:
                        delattr(module, key)
