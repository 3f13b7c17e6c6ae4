"""The TP forwards of linears (nn.Linear, transformers' Conv1D) and embeddings, and the class
swap that gives a module one: a subclass of its own class, so ``isinstance`` and state-dict
names are unchanged and a subclass that calls ``super().forward`` keeps its own part."""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from torchpp import ops
from torchpp.tensor_parallel.expert_linears import is_expert_linear
from torchpp.tensor_parallel.fused_qkv import copied_tail_linear
from torchpp.tensor_parallel.sharding import PlanError


def _linear(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], split_bw: bool):
    if split_bw:  # the weight gradient waits for the pipeline's W pass
        from torchpp.pipeline.split_linear import split_bw_linear

        return split_bw_linear(input, weight, bias)
    return F.linear(input, weight, bias)


@dataclass
class LinearTP:
    """A linear's TP behaviour (``module.tp``)."""

    group: dist.ProcessGroup
    column: bool  # output features split (else input features)
    gather_output: bool = False
    split_input: bool = False
    out_features: Optional[int] = None  # full width, to trim padding after a gather
    split_bw: bool = False
    scatter_output: bool = False  # row split whose output keeps this rank's slice (per-head outputs)
    copy_output: bool = False  # row split read by computations split over TP (f after g: their gradients are partial)
    copied_features: int = 0  # column split: last output features copied on every rank (fused_qkv)
    copy_slot: Tuple[int, int, bool] = (0, 1, True)  # FusedQKV.copy_slot: this rank's copied key/value head
    input_copied: bool = False  # column split whose input an f upstream already copied (its source's output)


class TPLinearForward:
    """The forward of a linear under a TP style (``module.tp`` says which)."""

    tp: LinearTP
    _splittable = True  # the split op defers the gradient of a leaf weight

    def _tp_weight(self) -> torch.Tensor:
        return self.weight

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        tp, weight = self.tp, self._tp_weight()
        split_bw = tp.split_bw and self._splittable
        if tp.column and tp.copied_features:
            return copied_tail_linear(input, weight, self.bias, tp.copied_features, tp.group, *tp.copy_slot)
        if tp.column:
            copied = input if tp.input_copied else ops.copy_to_tp_region(input, tp.group)
            output = _linear(copied, weight, self.bias, split_bw)
            if tp.gather_output:
                output = ops.gather_from_tp_region(output, tp.group, dim=-1)
                if output.size(-1) != tp.out_features:
                    output = output[..., : tp.out_features]  # padding rows of an uneven split
            return output
        if tp.split_input:
            input = ops.scatter_to_tp_region(input, tp.group, dim=-1)
        partial = _linear(input, weight, None, split_bw)
        if tp.scatter_output:  # the sum of this rank's output features only (backward: all-gather)
            output = ops.reduce_scatter_to_sp_region(partial, tp.group, dim=partial.dim() - 1)
        else:
            output = ops.reduce_from_tp_region(partial, tp.group)
        output = output if self.bias is None else output + self.bias
        return ops.copy_to_tp_region(output, tp.group) if tp.copy_output else output


class TPConv1DForward(TPLinearForward):
    """transformers' Conv1D (weight [in, out]) under a TP style."""

    _splittable = False  # W^T is not a leaf

    def _tp_weight(self) -> torch.Tensor:
        return self.weight.t()


@dataclass
class EmbeddingTP:
    group: dist.ProcessGroup
    vocab_parallel: bool  # rows split (else embedding columns)
    vocab_start: int = 0
    vocab_end: int = 0


class TPEmbeddingForward:
    """The forward of an nn.Embedding under a TP style."""

    tp: EmbeddingTP

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        tp = self.tp
        if not tp.vocab_parallel:
            local = F.embedding(input, self.weight, self.padding_idx)
            return ops.gather_from_tp_region(local, tp.group, dim=-1)
        outside = (input < tp.vocab_start) | (input >= tp.vocab_end)
        local_ids = (input - tp.vocab_start).masked_fill(outside, 0)
        padding = self.padding_idx
        padding = padding - tp.vocab_start if padding is not None and tp.vocab_start <= padding < tp.vocab_end else None
        partial = F.embedding(local_ids, self.weight, padding).masked_fill(outside.unsqueeze(-1), 0.0)
        return ops.reduce_from_tp_region(partial, tp.group)


_CLASSES: Dict[Tuple[type, type], type] = {}  # (model's class, TP forward) -> its TP class
_TP_BASES: Dict[Tuple[type, type], type] = {}  # (nn.Linear / nn.Embedding / Conv1D, TP forward) -> TP base


def _calls_super_forward(cls: type, base: type) -> bool:
    """Whether ``cls`` keeps ``base``'s forward: inherits it, or calls super().forward."""
    forward = cls.forward
    if forward is base.forward:
        return True
    try:
        return "super().forward(" in inspect.getsource(forward)
    except (OSError, TypeError):
        return False


# Relative difference allowed between a linear's own forward and its base's, per dtype (else 1e-2).
SAME_FORWARD_RTOL = {torch.float64: 1e-12, torch.float32: 1e-5}


def computes_base_forward(module: nn.Module, base: type) -> bool:
    """Whether a linear whose class writes its own forward computes its base's (Falcon's
    FalconLinear: ``input @ weight.T + bias`` by hand): it holds nothing but its weight and bias,
    and on two random inputs its forward equals ``base``'s. The TP forward, the same math over
    shards, then stands in for it. A module on the meta device cannot tell: False."""
    weight = getattr(module, "weight", None)
    held = {n for n, _ in module.named_parameters()} | {n for n, _ in module.named_buffers()}
    if base is nn.Embedding or not isinstance(weight, torch.Tensor) or weight.is_meta or weight.dim() != 2 \
            or held - {"weight", "bias"} or next(module.children(), None) is not None:
        return False
    width = weight.shape[1] if base is nn.Linear else weight.shape[0]  # Conv1D stores [in, out]
    generator = torch.Generator().manual_seed(0)
    rtol = SAME_FORWARD_RTOL.get(weight.dtype, 1e-2)
    with torch.no_grad():
        for rows in (3, 5):
            x = torch.randn(rows, width, generator=generator, dtype=torch.float64).to(weight.device, weight.dtype)
            try:
                own, reference = type(module).forward(module, x), base.forward(module, x)
            except Exception:  # noqa: BLE001 - a forward that cannot take a plain input is not a plain linear
                return False
            if not isinstance(own, torch.Tensor) or own.shape != reference.shape or \
                    not torch.allclose(own, reference, rtol=rtol, atol=rtol * float(reference.abs().max())):
                return False
    return True


def check_own_forward(module: nn.Module, base: Optional[type], name: str, style: str) -> None:
    """Raises PlanError where ``module``'s class computes its own forward, other than its base's
    math written out (``computes_base_forward``): a style swaps ``base``'s forward (None:
    nn.Linear's or Conv1D's) for a TP one, which that class would never call."""
    base = base or (nn.Linear if isinstance(module, nn.Linear) else _conv1d_class())
    if not _calls_super_forward(type(module), base) and not computes_base_forward(module, base):
        raise PlanError(f"torchpp plan: style {style!r} on {name}: its class {type(module).__name__} computes its own "
                        f"forward, which the style cannot shard; give it a {base.__name__} forward or leave it "
                        f"out of the plan")


def _swap_class(module: nn.Module, tp_forward: type, base: type, name: str, style: str) -> None:
    """Gives ``module`` a subclass of its own class in which ``base``'s forward is
    ``tp_forward``'s: a subclass whose forward calls ``super().forward`` (a scaled embedding)
    keeps its own part; one writing out ``base``'s math by hand (``computes_base_forward``) gets
    the TP forward in its place; ``isinstance`` and state-dict names are unchanged."""
    cls = type(module)
    if getattr(cls, "_torchpp_tp_class", False):
        raise PlanError(f"torchpp plan: {name} has two styles; the second is {style!r}")
    check_own_forward(module, base, name, style)
    key = (cls, tp_forward)
    if key not in _CLASSES:
        tp_base = _TP_BASES.setdefault((base, tp_forward), type(f"TP{base.__name__}", (tp_forward, base), {}))
        bases = (tp_base,) if cls is base else (cls, tp_base)
        body = {"_torchpp_tp_class": True, "__module__": cls.__module__}
        if not _calls_super_forward(cls, base):  # its forward is base's written out (check_own_forward)
            body["forward"] = tp_forward.forward
        _CLASSES[key] = type(f"TP{cls.__name__}", bases, body)
    module.__class__ = _CLASSES[key]


def _conv1d_class():
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # transformers is optional
        return None
    return Conv1D


def _linear_kind(module: nn.Module, name: str, style: str) -> str:
    if isinstance(module, nn.Linear):
        return "linear"
    conv1d = _conv1d_class()
    if conv1d is not None and isinstance(module, conv1d):
        return "conv1d"
    if is_expert_linear(module):
        return "experts"
    raise PlanError(f"torchpp plan: style {style!r} shards linear layers, but {name} is a {type(module).__name__}")


# The weight's output and input feature dims: nn.Linear [out, in], Conv1D [in, out], experts [E, out, in].
_FEATURE_DIMS = {"linear": (0, 1), "conv1d": (1, 0), "experts": (1, 2)}


def _out_dim(kind: str) -> int:
    return _FEATURE_DIMS[kind][0]


def _in_dim(kind: str) -> int:
    return _FEATURE_DIMS[kind][1]
