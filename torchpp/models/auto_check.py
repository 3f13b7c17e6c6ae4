"""plan="auto"'s groups tried before any rank splits them: each group the rule would split (a
writer, the readers feeding it and the parameters between) is run on one layer in this process,
once per TP rank with that rank's shards (and head counts), with the layer's traced inputs; the
writer's outputs summed over the simulated ranks must equal the unsplit layer's. A group whose
split fails there (a module that cuts a split output by hard-coded sizes, reshapes by its input's
width) or changes the result stays whole: a working wrap of what can be split, never a wrong one.
Where the attention module was handed a bias for every head (ALiBi), the group is tried again with
that bias cut to each rank's heads (``head_inputs_entry``). One layer of each kind is tried (layers of one
class with the same groups share the answer); copies are run in eval mode, so dropout draws
nothing.
"""
from __future__ import annotations

import copy
import types
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from torchpp.models.auto_fused_qkv import fused_qkv_variants
from torchpp.models.auto_trace import WHOLE_STYLES, is_linear
from torchpp.tensor_parallel.head_inputs import (head_inputs_style, parse_head_inputs_style, per_head_inputs,
                                                 slice_head_inputs)
from torchpp.tensor_parallel.expert_linears import is_expert_linear
from torchpp.tensor_parallel.local_widths import divide_widths, local_widths_style, parse_local_widths_style
from torchpp.tensor_parallel.random import rng_restored
from torchpp.tensor_parallel.styles import STYLES, PlanError, TPContext
from torchpp.tensor_parallel.tp_forwards import check_own_forward

# |sum of the ranks' writer outputs - the unsplit one| allowed, relative to its scale, per dtype.
TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4}
HALF_TOLERANCE = 2e-2
ROW_STYLES = ("rowwise",)


def keep_groups_that_split(traces, groups: List[List[Dict[str, str]]], ctx: TPContext
                           ) -> Tuple[List[List[Dict[str, str]]], Dict[str, str]]:
    """``groups`` (per layer) without those whose split fails or changes the layer's result.

    Args:
        traces: ``auto_trace.LayerTrace`` of each layer (the layer, its path, its traced call).
        groups: per layer, the groups ``LayerTrace.decide`` chose.
        ctx: the TP context (size and head counts) to simulate.

    Returns:
        (the groups kept, {writer: its readers and why their group stays whole}).
    """
    answers: Dict[tuple, Tuple[Optional[Dict[str, str]], str]] = {}
    kept, whole = [], {}
    for trace, layer_groups in zip(traces, groups):
        mine = []
        for group in layer_groups:
            relative = {name[len(trace.path) + 1:]: style for name, style in group.items()}
            key = (type(trace.layer), tuple(sorted(relative.items())))
            if key not in answers:
                answers[key] = _first_that_holds(trace.layer, trace.call, relative, ctx,
                                                 head_inputs_entry(trace, relative, ctx))
            holding, why = answers[key]
            if holding is None:
                readers = ", ".join(n for n, s in relative.items() if s.startswith(("colwise", "packed"))
                                    and isinstance(_get(trace.layer, n), nn.Module))
                whole[_writer(group)] = f"with its readers {readers}: {why}"
            else:
                mine.append({f"{trace.path}.{name}": style for name, style in holding.items()})
        kept.append(_without_sharing(mine, [g for g in layer_groups if _writer(g) in whole], whole))
    return kept, whole


def _without_sharing(kept: List[Dict[str, str]], dropped: List[Dict[str, str]], whole: Dict[str, str]
                     ) -> List[Dict[str, str]]:
    """``kept`` without the groups sharing a reader with a dropped one (a reader splits for all
    the writers it feeds, or none), recorded in ``whole``."""
    def readers(group):
        return {name for name, style in group.items() if style.startswith(("colwise", "packed"))}

    while True:
        shared = {_writer(g): next((d for d in dropped if readers(g) & readers(d)), None) for g in kept}
        if not any(shared.values()):
            return kept
        for writer, other in shared.items():
            if other is not None:
                whole[writer] = f"shares a reader with {_writer(other).rpartition('.')[2]}'s group, kept whole"
        dropped = dropped + [g for g in kept if shared[_writer(g)] is not None]
        kept = [g for g in kept if shared[_writer(g)] is None]


def _first_that_holds(layer, call, group: Dict[str, str], ctx, head_inputs: Optional[Dict[str, str]] = None
                      ) -> Tuple[Optional[Dict[str, str]], str]:
    """``group``, or failing that the same with its column-split readers split as 2 or 3 equal
    fused parts (an output cut in parts by a view, which the trace cannot tell from heads:
    Moshi's gate and up), or as fused q/k/v of unequal parts (``auto_fused_qkv``), then each of
    these with ``head_inputs`` (the attention module's per-head inputs cut to each rank's heads:
    ALiBi), whichever holds first; (None, why the group itself does not)."""
    why = _why_not(layer, call, group, ctx)
    if why is None:
        return group, ""
    variants = []
    for parts, packed in ((2, "packed_colwise"), (3, "packed3_colwise")):
        readers = [n for n, s in group.items() if s == "colwise" and not isinstance(_get(layer, n), nn.Parameter)]
        if not readers or any(_get(layer, n).weight.shape[0 if isinstance(_get(layer, n), nn.Linear) else 1]
                              % (parts * ctx.size) for n in readers):
            continue
        variants.append({**group, **{n: packed for n in readers}})
    variants += fused_qkv_variants(layer, group, ctx)  # fused q/k/v of unequal parts (multi-query attention)
    variants += [whole for whole in (_per_head_vectors_whole(layer, v) for v in [group] + variants) if whole]
    variants += [local for v in [group] + variants for local in _local_width_variants(layer, v)]
    if head_inputs:
        variants += [{**variant, **head_inputs} for variant in [group] + variants]
    sliced_why = ""
    for variant in variants:
        variant_why = _why_not(layer, call, variant, ctx)
        if variant_why is None:
            return variant, ""
        if head_inputs and not sliced_why and set(head_inputs) <= set(variant):
            sliced_why = f"; with {next(iter(head_inputs.values()))} it fails too: {variant_why}"
    return None, why + sliced_why


def _per_head_vectors_whole(layer: nn.Module, group: Dict[str, str]) -> Optional[Dict[str, str]]:
    """``group`` with the vectors it splits as one value per head kept whole instead, their
    gradients summed over TP (a vector as long as a head count by chance: DiffLlama's lambdas of
    head_dim values where head_dim equals the heads); None if it splits none."""
    vectors = [name for name, style in group.items() if style == "colwise" and isinstance(_get(layer, name), nn.Parameter)]
    if not vectors:
        return None
    return {**{n: s for n, s in group.items() if n not in vectors},
            **{n: "replicated_with_grad_allreduce" for n in vectors}}


def _local_width_variants(layer: nn.Module, group: Dict[str, str]) -> List[Dict[str, str]]:
    """``group`` once per integer attribute of a module holding a column-split expert linear that
    equals the linear's whole output width, with that attribute divided by the TP size
    (``local_widths``), then with all of them: the module may build that width itself."""
    variants = []
    for name, style in group.items():
        target = _get(layer, name)
        if not (style.startswith(("colwise", "packed")) and isinstance(target, nn.Module) and is_expert_linear(target)):
            continue
        holder = name.rpartition(".")[0]
        owner = layer.get_submodule(holder) if holder else None
        if owner is None or holder in group:
            continue
        width = target.weight.shape[1]
        names = sorted(a for a, v in vars(owner).items() if isinstance(v, int) and not isinstance(v, bool) and v == width)
        choices = [[a] for a in names] + ([names] if len(names) > 1 else [])
        variants += [{**group, holder: local_widths_style(choice)} for choice in choices]
    return variants


def head_inputs_entry(trace, group: Dict[str, str], ctx: TPContext) -> Dict[str, str]:
    """{the module holding ``group``'s linears: ``split_head_inputs(...)``} where that module (an
    attention block) was called with inputs holding every head (``head_inputs.per_head_inputs``);
    empty otherwise, or where the linears' common holder is the layer itself."""
    parents = [name.split(".")[:-1] for name in group if is_linear(_get(trace.layer, name))]
    common: List[str] = []
    for parts in zip(*parents):
        if len(set(parts)) > 1:
            break
        common.append(parts[0])
    owner = ".".join(common)
    if not parents or not owner or owner not in trace.calls or not ctx.num_heads:
        return {}
    names = per_head_inputs(trace.layer.get_submodule(owner), *trace.calls[owner], ctx.num_heads)
    return {owner: head_inputs_style(names)} if names else {}


def _get(layer: nn.Module, name: str):
    parent, _, leaf = name.rpartition(".")
    return getattr(layer.get_submodule(parent) if parent else layer, leaf)


def sized_context(model: nn.Module, tp: int) -> TPContext:
    """A TP context of ``tp`` ranks and ``model``'s head counts, with no process group: enough to
    try splits in this process (``auto_plans(model, tp=...)`` without ranks)."""
    from torchpp.models.passes.resolve import tp_context

    return tp_context(model, types.SimpleNamespace(tp_group=_Sized(tp)), False, False)


class _Sized:
    def __init__(self, size: int):
        self._size = size

    def size(self) -> int:
        return self._size


def _writer(group: Dict[str, str]) -> str:
    return next(name for name, style in group.items() if style in ROW_STYLES + ("rowwise_split_input",))


def _why_not(layer: nn.Module, call, group: Dict[str, str], ctx: TPContext) -> Optional[str]:
    """None if ``layer`` with ``group`` split over ``ctx.size`` simulated ranks gives the unsplit
    writer output (summed over ranks); else why not, in a line."""
    writer = _writer(group)
    for name, style in group.items():
        target = _get(layer, name)
        if isinstance(target, nn.Module) and _shards_parameters(style) and not is_expert_linear(target):
            try:
                check_own_forward(target, None, name, style)
            except PlanError:  # parallelize would refuse the style on it
                return f"{name}'s class {type(target).__name__} computes its own forward, which no TP style can shard"
    if group[writer] not in ROW_STYLES or call is None:
        return None  # a gathered group computes whole activations: nothing the split could change
    args, kwargs = detached(call)
    try:
        expected = _writer_output(_copy(layer, {}), writer, args, kwargs, backward=False)
    except Exception:  # noqa: BLE001 - a layer that cannot be called again here is split untried, as before
        return None
    total = None
    for rank in range(ctx.size):
        local = _copy(layer, group)
        try:
            _shard(local, group, ctx, rank)
            output = _writer_output(local, writer, args, kwargs, backward=True)
        except Exception as error:  # noqa: BLE001 - any failure of the split layer is the answer
            return f"split over tp={ctx.size} it fails: {type(error).__name__}: {str(error).splitlines()[0][:160]}"
        if output is None or expected is None or output.shape != expected.shape:
            return f"split over tp={ctx.size}, {writer} does not give the unsplit layer's output shape"
        total = output if total is None else total + output
    difference = summed_difference(total, expected)
    if difference is not None:
        return f"split over tp={ctx.size}, the summed outputs of {writer} differ from the unsplit ones by {difference:.2e}"
    return None


def summed_difference(total: torch.Tensor, expected: torch.Tensor) -> Optional[float]:
    """|the simulated ranks' summed outputs - the unsplit ones| where beyond the dtype's tolerance
    (relative to the output's scale); None where they agree."""
    tolerance = TOLERANCE.get(expected.dtype, HALF_TOLERANCE) * max(1.0, expected.abs().max().item())
    difference = (total - expected).abs().max().item()
    return difference if difference > tolerance else None


def _copy(layer: nn.Module, group: Dict[str, str]) -> nn.Module:
    """A copy of ``layer`` in eval mode in which only the parameters ``group`` splits are copied:
    the others are ``layer``'s own, detached (read, never given a gradient), so a trial costs the
    group's weights, not the layer's (a MoE layer's experts are not copied once per simulated
    rank). State a layer keeps from the traced call (a recurrent state with autograd history,
    which deepcopy refuses) is copied detached."""
    memo = {id(value): value.detach().clone() for module in layer.modules() for value in vars(module).values()
            if isinstance(value, torch.Tensor) and value.grad_fn is not None}
    split = {id(p) for p in _split_parameters(layer, group)}
    memo.update({id(p): p.detach() for p in layer.parameters() if id(p) not in split})
    return copy.deepcopy(layer, memo).eval()


def _split_parameters(layer: nn.Module, group: Dict[str, str]) -> List[torch.Tensor]:
    """The parameters ``group`` shards (a split module's, or a split parameter itself)."""
    found = []
    for name, style in group.items():
        if _shards_parameters(style):
            target = _get(layer, name)
            found += [target] if isinstance(target, nn.Parameter) else list(target.parameters())
    return found


def _shards_parameters(style: str) -> bool:
    """Whether ``style`` shards what it names (not: whole, per-head inputs, widths)."""
    return style not in WHOLE_STYLES and parse_head_inputs_style(style) is None and \
        parse_local_widths_style(style) is None


def detached(call):
    """(args, kwargs) of a recorded call, their tensors detached."""
    def detach(value):
        if isinstance(value, torch.Tensor):
            return value.detach()
        if isinstance(value, (tuple, list)):
            return type(value)(detach(v) for v in value)
        return value

    args, kwargs = call
    return detach(tuple(args)), {key: detach(value) for key, value in kwargs.items()}


def _writer_output(layer: nn.Module, writer: str, args, kwargs, backward: bool) -> Optional[torch.Tensor]:
    """The writer's first output when ``layer`` runs on the traced call (and, with ``backward``,
    after a backward through the layer: a split that breaks only the backward fails here); copied
    as it leaves the writer, before an in-place op adds to it (Falcon's parallel attention)."""
    seen: List[torch.Tensor] = []
    hook = layer.get_submodule(writer).register_forward_hook(
        lambda module, inputs, output: seen.append(output.detach().clone()) if not seen else None)
    try:
        device = next((p.device for p in layer.parameters()), torch.device("cpu"))
        with rng_restored(device), \
                torch.enable_grad():
            output = layer(*args, **kwargs)
    finally:
        hook.remove()
    if backward:
        from torchpp.models.autograd_walk import first_tensor

        out = first_tensor(output)
        if out is not None and out.requires_grad:
            out.sum().backward()
    return seen[0] if seen else None


def _shard(layer: nn.Module, group: Dict[str, str], ctx: TPContext, rank: int) -> None:
    """Gives ``layer`` (a copy) TP rank ``rank``'s shards of ``group`` and its head counts; a
    row-split linear's bias is divided by the ranks, so that the outputs sum to the unsplit one."""
    from torchpp.models.auto_plan import divide_head_attributes

    for name, style in group.items():
        if style in WHOLE_STYLES:  # forward unchanged (an f is the identity there)
            continue
        target = _get(layer, name)
        if parse_head_inputs_style(style) is not None:  # the attention's per-head inputs: this rank's heads
            slice_head_inputs(target, parse_head_inputs_style(style), ctx.num_heads, rank, ctx.size, name)
            continue
        if parse_local_widths_style(style) is not None:  # widths the module builds itself: this rank's
            divide_widths(target, parse_local_widths_style(style), ctx.size, name)
            continue
        if isinstance(target, nn.Parameter):  # a per-head vector split with the heads
            parent, _, leaf = name.rpartition(".")
            owner = layer.get_submodule(parent) if parent else layer
            _set(owner, leaf, STYLES[style].local_value(target, leaf, rank, ctx.size))
            continue
        weight_layout, bias_layout = STYLES[style].layouts(target, name, ctx)
        _set(target, "weight", weight_layout.shard(target.weight.data, rank, ctx.size))
        if hasattr(target, "nf"):  # transformers' Conv1D shapes its output by nf (its TP forward reads the weight)
            target.nf = target.weight.shape[-1]
        if getattr(target, "bias", None) is not None:
            bias = bias_layout.shard(target.bias.data, rank, ctx.size)
            _set(target, "bias", bias / ctx.size if style in ROW_STYLES else bias)
    divide_head_attributes(layer, group, ctx)


def _set(module: nn.Module, name: str, value: torch.Tensor) -> None:
    setattr(module, name, nn.Parameter(value.clone(), requires_grad=getattr(module, name).requires_grad))
