"""Per-head inputs of head-split attention: a bias built outside the attention for every head
(BLOOM's and Falcon's ALiBi, [batch*heads, 1, keys] or [batch, heads, queries, keys]; MPT's
position bias, [heads, 1, keys]) reaches each TP rank whole while the rank computes only its own
heads. The style ``split_head_inputs(name, ...)`` on the attention module gives the named inputs
this rank's heads [r*H/t, (r+1)*H/t) before the module runs, as Megatron-DeepSpeed slices BLOOM's
ALiBi slopes per TP rank (rebuilding the bias for H/t heads would give other slopes).

A bias added to the attention scores [..., heads, queries, keys] holds its heads in dimension -3,
alone or flattened with the batch before them (batch-major, as ``reshape`` of [batch, heads]
gives): that is where the slice takes them. A learned bias (CPM-Ant's relative position bias,
built once from an embedding for every layer) is cut by ``scatter_to_tp_region``, whose backward
all-gathers the heads' gradients: every rank's copy of the embedding gets the whole gradient.
"""
from __future__ import annotations

import inspect
from typing import Dict, Optional, Sequence, Tuple

import torch
from torch import nn

from torchpp import ops
from torchpp.tensor_parallel.sharding import PlanError, TPContext
from torchpp.tensor_parallel.style_base import names_of_style, style_with_names
from torchpp.tensor_parallel.styles import Style

STYLE = "split_head_inputs"


def head_inputs_style(names: Sequence[str]) -> str:
    """The style name slicing the inputs ``names``: ``split_head_inputs(alibi,attention_mask)``."""
    return style_with_names(STYLE, names)


def parse_head_inputs_style(style: str) -> Optional[Tuple[str, ...]]:
    """The input names of a ``split_head_inputs(...)`` style name; None for any other style."""
    return names_of_style(STYLE, style)


class SplitHeadInputs(Style):
    """Gives a head-split attention module this rank's heads of the inputs it names."""

    def __init__(self, names: Sequence[str]):
        self.names = tuple(names)
        self.name = head_inputs_style(self.names)

    def apply(self, module: nn.Module, name: str, ctx: TPContext) -> None:
        if not ctx.num_heads:
            raise PlanError(f"torchpp plan: style {self.name!r} on {name} needs the model's head count "
                            f"(num_attention_heads), which its config does not give")
        ctx.hooks.append(module.register_forward_pre_hook(_needs_split_projections(name)))
        ctx.hooks.append(slice_head_inputs(module, self.names, ctx.num_heads, ctx.rank, ctx.size, name, ctx.group))


def _needs_split_projections(where: str):
    """A pre-hook refusing to cut the inputs of a module that computes every head (a plan by hand
    naming the style on an attention whose projections it leaves whole)."""
    def hook(module, args):
        if not any(getattr(getattr(p, "tp_layout", None), "dim", None) is not None for p in module.parameters()):
            raise PlanError(f"torchpp plan: {where} has style 'split_head_inputs', but none of its projections is "
                            f"split over TP: it computes every head, so its inputs must stay whole")
    return hook


def head_inputs_style_of(style: str) -> Optional[Style]:
    """The style a ``split_head_inputs(...)`` name stands for (None for another name)."""
    names = parse_head_inputs_style(style)
    if names is None:
        return None
    if not names:
        raise PlanError(f"torchpp plan: style {style!r} names no input to slice")
    return SplitHeadInputs(names)


def _positions(module: nn.Module, names: Sequence[str], where: str) -> Dict[str, Optional[int]]:
    """{input name: its position among ``module.forward``'s positional parameters, None if keyword-only
    or caught by **kwargs}; a name the forward cannot take raises."""
    parameters = list(inspect.signature(module.forward).parameters.values())
    positional = [p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    known = {p.name for p in parameters}
    takes_any = any(p.kind == p.VAR_KEYWORD for p in parameters)
    positions = {}
    for name in names:
        if name not in known and not takes_any:
            raise PlanError(f"torchpp plan: {where} ({type(module).__name__}) has no input named {name!r} to give "
                            f"its heads; its inputs: {sorted(known)}")
        positions[name] = positional.index(name) if name in positional else None
    return positions


def slice_head_inputs(module: nn.Module, names: Sequence[str], heads: int, rank: int, size: int,
                      where: str, group=None) -> torch.utils.hooks.RemovableHandle:
    """Registers the forward pre-hook giving ``module`` rank ``rank``'s heads of its inputs ``names``.

    Args:
        module: the attention module whose projections are split over ``size`` ranks.
        names: its inputs holding every head (None or non-tensor values pass unchanged).
        heads: the model's (unsplit) query head count.
        rank, size: this rank in the TP group and the group's size.
        where: the module's name, for errors.
        group: the TP group, which a learned input's cut needs (its backward gathers the heads'
            gradients); None in the one-process trial (auto_check), which only runs forward.
    """
    if heads % size:
        raise PlanError(f"torchpp plan: {where}: tp={size} does not divide its {heads} heads")
    positions = _positions(module, names, where)

    def hook(_, args, kwargs):
        args, kwargs = list(args), dict(kwargs)
        hidden = next((a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)), None)
        batch = hidden.shape[0] if hidden is not None and hidden.dim() > 0 else 1
        for name in names:
            at = positions[name]
            if name in kwargs:
                kwargs[name] = own_heads(kwargs[name], heads, rank, size, batch, f"{where}'s input {name}", group)
            elif at is not None and at < len(args):
                args[at] = own_heads(args[at], heads, rank, size, batch, f"{where}'s input {name}", group)
        return tuple(args), kwargs

    return module.register_forward_pre_hook(hook, with_kwargs=True)


def own_heads(value, heads: int, rank: int, size: int, batch: int, what: str, group=None):
    """This rank's heads of ``value`` (its dimension -3 holds ``heads`` heads, or ``batch`` x heads
    batch-major); anything but a tensor, or one broadcast over the heads (size 1 there), passes unchanged.
    A value that needs a gradient is cut over ``group`` by an op gathering the heads' gradients."""
    if not isinstance(value, torch.Tensor) or (value.dim() >= 3 and value.shape[-3] == 1):
        return value
    rows = value.shape[-3] if value.dim() >= 3 else None
    if rows is None or rows % heads or rows // heads not in (1, batch):
        raise ValueError(f"torchpp split_head_inputs: {what} of shape {tuple(value.shape)} does not hold {heads} "
                         f"heads (or batch {batch} x {heads}) in dimension -3")
    local, lead, tail = heads // size, value.shape[:-3], value.shape[-2:]
    grouped = value.reshape(*lead, rows // heads, heads, *tail)
    if value.requires_grad and group is not None:
        grouped = ops.scatter_to_tp_region(grouped, group, dim=grouped.dim() - 3)
    else:
        grouped = grouped[..., rank * local:(rank + 1) * local, :, :]
    return grouped.reshape(*lead, rows // heads * local, *tail)


def per_head_inputs(module: nn.Module, args, kwargs, heads: int) -> Tuple[str, ...]:
    """The names of ``module``'s inputs in a traced call that hold every one of ``heads`` heads in
    dimension -3 (alone or times the batch of its first tensor input), in floating point (a constant
    bias, or a learned one, whose cut gathers its gradient): what ``split_head_inputs`` could
    slice. A guess that the one-layer split trial (auto_check) confirms."""
    parameters = inspect.signature(module.forward).parameters
    try:
        bound = inspect.signature(module.forward).bind_partial(*args, **kwargs).arguments
    except TypeError:  # a call the signature does not describe: nothing to name
        return ()
    values = {name: v for name, v in bound.items() if parameters[name].kind != inspect.Parameter.VAR_POSITIONAL}
    for extra in [n for n, p in parameters.items() if p.kind == p.VAR_KEYWORD]:
        values.update(values.pop(extra, {}) or {})
    hidden = next((v for v in list(args) + list(kwargs.values()) if isinstance(v, torch.Tensor)), None)
    if hidden is None:
        return ()
    batch = hidden.shape[0] if hidden.dim() > 0 else 1
    return tuple(name for name, v in values.items() if isinstance(v, torch.Tensor) and v is not hidden
                 and v.is_floating_point() and v.dim() >= 3
                 and v.shape[-3] in (heads, batch * heads))
