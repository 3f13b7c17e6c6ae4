"""plan="auto"'s mixture-of-experts MLPs held as raw 3-D parameters (transformers' experts modules:
``gate_up_proj`` [E, 2I, H] or an ungated ``up_proj`` [E, I, H], and ``down_proj`` [E, H, I]; Llama
4's and GPT-OSS's transposed [E, H, 2I] and [E, I, H]), which hold most of a MoE model's weights and
no ``nn.Linear`` for the trace to follow. They split as transformers' own plans split them
(Qwen3-MoE's): each rank holds its share of every expert's intermediate features, gate and up half
by half (or pair by pair where they alternate, GPT-OSS's); the tokens and routing weights enter
through f and the partial outputs are summed (``moe_tp_experts``). Per-expert biases split with
them: the up bias like the up weight's features, the down bias, added before the sum, as
``partial_sum_bias``. Each kind of experts module is first tried in this process on the call the
traced forward made to it, once per simulated rank, and stays whole (named in the log, with why)
where every split fails or its summed outputs differ from the unsplit module's (one summing an
identity expert once per rank, one holding other parameters)."""
from __future__ import annotations

import copy
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from torchpp.models.auto_check import detached, summed_difference
from torchpp.tensor_parallel.random import rng_restored
from torchpp.tensor_parallel.styles import STYLES, TPContext

UP_NAMES = ("gate_up_proj", "up_proj")
# (up, down) styles to try per layout, in order: [E, out, in] weights split like linears, the transposed
# ones mirrored; gate and up fused as two halves first, then alternating (each rank's features whole pairs).
LAYOUT_STYLES = {("standard", True): [("packed_colwise", "rowwise"), ("colwise", "rowwise")],
                 ("standard", False): [("colwise", "rowwise")],
                 ("transposed", True): [("packed_rowwise", "colwise"), ("rowwise", "colwise")],
                 ("transposed", False): [("rowwise", "colwise")]}
DOWN_BIAS = "down_proj_bias"


def experts_parameters(module: nn.Module) -> Optional[Tuple[str, torch.Tensor, torch.Tensor]]:
    """(the up parameter's name, it, ``down_proj``) where ``module`` holds 3-D experts' weights
    of one expert count; else None."""
    params = dict(module.named_parameters(recurse=False))
    name = next((n for n in UP_NAMES if n in params), None)
    down = params.get("down_proj")
    if name is None or down is None or params[name].dim() != 3 or down.dim() != 3 or \
            params[name].shape[0] != down.shape[0]:
        return None
    return name, params[name], down


def split_weight(module: nn.Module) -> Optional[torch.Tensor]:
    """The tensor whose size tells whether ``module`` was split: a linear's weight, an experts
    module's ``down_proj``."""
    found = experts_parameters(module)
    return found[2] if found else getattr(module, "weight", None)


def _layouts(up_name: str, up: torch.Tensor, down: torch.Tensor) -> List[Tuple[str, bool]]:
    """(layout, gated) readings of the shapes that fit: standard, transposed, or both (square)."""
    gated = up_name == "gate_up_proj"
    factor = 2 if gated else 1
    fits = []
    if up.shape[2] == down.shape[1] and up.shape[1] == factor * down.shape[2]:
        fits.append(("standard", gated))
    if up.shape[1] == down.shape[2] and up.shape[2] == factor * down.shape[1]:
        fits.append(("transposed", gated))
    return fits


class ExpertCalls:
    """Hooks recording the first call of each experts module of the stack's layers (the trace's
    forward makes it), and the split each kind of them takes."""

    def __init__(self, model: nn.Module, stack: str):
        layers = model.get_submodule(stack)
        self.modules: Dict[str, nn.Module] = {f"{stack}.{i}.{name}": module for i, layer in enumerate(layers)
                                              for name, module in layer.named_modules()
                                              if experts_parameters(module) is not None}
        self.calls: Dict[str, tuple] = {}
        self._hooks = [module.register_forward_pre_hook(self._called(name), with_kwargs=True)
                       for name, module in self.modules.items()]

    def _called(self, name: str):
        def hook(module, args, kwargs):
            self.calls.setdefault(name, detached((args, kwargs)))
        return hook

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()

    def plan(self, ctx: TPContext, taken: Dict[str, str]) -> Tuple[Dict[str, str], Dict[str, str]]:
        """({name: style} splitting each experts module whose split holds, {name: why kept whole}).
        ``taken``: the plan so far (a module it already styles is left to it)."""
        answers: Dict[tuple, Tuple[Optional[Dict[str, str]], str]] = {}
        split, whole = {}, {}
        for name, module in self.modules.items():
            if name in taken or name not in self.calls:
                whole[name] = "already styled by the plan" if name in taken else "the traced forward did not call it"
                continue
            up_name, up, down = experts_parameters(module)
            key = (type(module), tuple(up.shape), tuple(down.shape))
            if key not in answers:
                answers[key] = _first_split_that_holds(module, self.calls[name], ctx)
            entries, why = answers[key]
            if entries is None:
                whole[name] = why
            else:
                split.update({name: "moe_tp_experts", **{f"{name}.{p}": s for p, s in entries.items()}})
        return split, whole


def _first_split_that_holds(module: nn.Module, call, ctx: TPContext) -> Tuple[Optional[Dict[str, str]], str]:
    """({parameter: style}, "") for the first layout reading whose split over ``ctx.size``
    simulated ranks gives the unsplit output; (None, why) where none does."""
    up_name, up, down = experts_parameters(module)
    fits = _layouts(up_name, up, down)
    if not fits:
        return None, f"{up_name} {tuple(up.shape)} and down_proj {tuple(down.shape)} fit no experts layout"
    why = ""
    for layout in fits:
        for up_style, down_style in LAYOUT_STYLES[layout]:
            entries, why = _with_biases(module, layout, {up_name: up_style, "down_proj": down_style})
            if entries is None:
                return None, why
            why = _why_not(module, call, entries, ctx)
            if why is None:
                return entries, ""
    return None, why


def _with_biases(module: nn.Module, layout: Tuple[str, bool], entries: Dict[str, str]) \
        -> Tuple[Optional[Dict[str, str]], str]:
    """``entries`` plus the per-expert biases' styles ([E, features] each: the up bias split like
    the up weight's features, the down bias added once over the ranks); (None, why) where the
    module holds any other parameter."""
    (up_name, up_style), = ((n, s) for n, s in entries.items() if n != "down_proj")
    up, down = getattr(module, up_name), module.down_proj
    transposed = layout[0] == "transposed"
    widths = {f"{up_name}_bias": up.shape[2] if transposed else up.shape[1],
              DOWN_BIAS: down.shape[2] if transposed else down.shape[1]}
    others = sorted(n for n, p in module.named_parameters() if n not in entries and
                    not (n in widths and tuple(p.shape) == (up.shape[0], widths[n])))
    if others:
        return None, f"holds {', '.join(others)} besides its experts' weights and [experts, features] biases"
    biases = {f"{up_name}_bias": "packed_colwise" if up_style.startswith("packed") else "colwise",
              DOWN_BIAS: "partial_sum_bias"}
    return {**entries, **{n: s for n, s in biases.items() if getattr(module, n, None) is not None}}, ""


def _why_not(module: nn.Module, call, entries: Dict[str, str], ctx: TPContext) -> Optional[str]:
    args, kwargs = call
    try:
        expected = _run(module, {}, args, kwargs)
        total = None
        for rank in range(ctx.size):
            shards = {name: STYLES[style].local_value(getattr(module, name), name, rank, ctx.size).clone()
                      for name, style in entries.items()}
            output = _run(module, shards, args, kwargs)
            total = output if total is None else total + output
    except Exception as error:  # noqa: BLE001 - any failure of the split module is the answer
        return f"split over tp={ctx.size} it fails: {type(error).__name__}: {str(error).splitlines()[0][:160]}"
    if not isinstance(total, torch.Tensor) or total.shape != expected.shape:
        return f"split over tp={ctx.size} it does not give the unsplit module's output shape"
    difference = summed_difference(total, expected)
    if difference is not None:
        return f"split over tp={ctx.size}, its summed outputs differ from the unsplit ones by {difference:.2e}"
    return None


def _run(module: nn.Module, shards: Dict[str, torch.Tensor], args, kwargs) -> torch.Tensor:
    """``module``'s output on the call, in eval mode, with ``shards`` in place of those parameters:
    a shallow copy holds them (the experts' weights are never copied whole)."""
    local = copy.copy(module)
    local._parameters = {**module._parameters, **shards}
    local.training = False
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    with torch.no_grad(), rng_restored(device):
        output = local(*args, **kwargs)
    return output[0] if isinstance(output, tuple) else output

