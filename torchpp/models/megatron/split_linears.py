"""Megatron's tensor-parallel linears with a weight gradient that waits for the W pass.

Megatron's ``ColumnParallelLinear`` and ``RowParallelLinear`` compute ``x W^T + b`` in their
``_forward_impl``, which also all-reduces the input gradient (or all-gathers the sequence
under sequence parallelism). ``route_split_bw`` replaces that one method, per instance, with
torchpp's mapping (``copy_to_tp_region`` or ``gather_from_sp_region``) followed by the split
B/W linear: same parameters, same forward, same input gradient in I, the weight and bias
gradients in W. The layers' own forward (bias handling, the row layer's reduction) stays
Megatron's.

Transformer Engine's layers defer their weight gradient themselves when the model's config
has ``delay_wgrad_compute``; ``te_backward_dw_modules`` finds them so the W pass can call
their ``backward_dw()`` (not exercised here: it needs a GPU with Transformer Engine).
"""
from __future__ import annotations

import types
from typing import List

import torch
from torch import nn

from torchpp import ops
from torchpp.pipeline.split_linear import split_bw_linear

_ROUTED = "_torchpp_split_bw"


# Megatron's linear_with_grad_accumulation_and_async_allreduce, positionally after (input, weight).
_IMPL_ARGS = ("bias", "gradient_accumulation_fusion", "allreduce_dgrad", "sequence_parallel", "grad_output_buffer",
              "wgrad_deferral_limit", "async_grad_allreduce", "tp_group")


def _split_forward_impl(self, input: torch.Tensor, weight: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """Megatron's ``_forward_impl`` contract over torch.ops.torchpp (gradient accumulation
    fusion is replaced: W accumulates into ``.grad``, whence Megatron's DDP hook moves it)."""
    options = dict(zip(_IMPL_ARGS, args), **kwargs)
    if not weight.requires_grad or options.get("grad_output_buffer") is not None:
        # A frozen weight has no W; the deferred embedding wgrad is Megatron's own scheme.
        return self._torchpp_megatron_forward_impl(input, weight, *args, **kwargs)
    tp_group = options.get("tp_group") or self.tp_group
    if options.get("sequence_parallel"):
        input = ops.gather_from_sp_region(input, tp_group, dim=0)
    elif options.get("allreduce_dgrad"):
        input = ops.copy_to_tp_region(input, tp_group)
    return split_bw_linear(input, weight, options.get("bias"))


def megatron_tp_linear_classes() -> tuple:
    """Megatron-core's local ColumnParallelLinear and RowParallelLinear (exact classes and
    subclasses that keep ``_forward_impl``)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    return ColumnParallelLinear, RowParallelLinear


def route_split_bw(module: nn.Module) -> List[nn.Module]:
    """Routes every Megatron TP linear in ``module`` through the split B/W op (idempotent).

    Args:
        module: a Megatron model chunk (possibly wrapped by Megatron's DDP or Float16Module).

    Returns:
        The routed layers.
    """
    column, row = megatron_tp_linear_classes()
    routed = []
    for layer in module.modules():
        if not isinstance(layer, (column, row)):
            continue
        if not getattr(layer, _ROUTED, False):
            # Instance attributes shadow the class method; the original stays reachable.
            layer._torchpp_megatron_forward_impl = layer._forward_impl
            layer._forward_impl = types.MethodType(_split_forward_impl, layer)
            setattr(layer, _ROUTED, True)
        routed.append(layer)
    return routed


def te_backward_dw_modules(module: nn.Module) -> List[nn.Module]:
    """Transformer Engine layers of ``module`` that defer their weight gradient until
    ``backward_dw()`` (Megatron's ``delay_wgrad_compute``), in module order."""
    found = []
    for layer in module.modules():
        owner = type(layer).__module__
        config = getattr(layer, "config", None)
        if (owner.startswith("megatron.core.extensions.transformer_engine") and hasattr(layer, "backward_dw")
                and getattr(config, "delay_wgrad_compute", False)):
            found.append(layer)
    return found
