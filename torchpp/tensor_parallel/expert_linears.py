"""Linears of several experts held as one 3-D weight [experts, out, in], each expert applied to its
own rows of the input (JetMoE's ``JetMoeParallelExperts``, the layout MegaBlocks, ScatterMoE and
vLLM's fused MoE read). They split like a linear, every expert alike: by columns, each rank holds
its output features of every expert (dim 1) and an f sums its input's gradient; by rows, its input
features of every expert (dim 2) and a g sums the partial outputs. The module's own forward runs
on the shards as it is, so hooks carry the f and the g."""
from __future__ import annotations

import copy
import inspect
from typing import Dict

import torch
import torch.nn.functional as F
from torch import nn

from torchpp import ops

# The class's forward, checked once on a module of it with weights: expert linears or not.
_VERDICTS: Dict[type, bool] = {}
ROWS_PER_EXPERT = (2, 1)  # uneven rows per expert: a forward cutting the input evenly fails the check


def is_expert_linear(module: nn.Module) -> bool:
    """Whether ``module`` holds only a 3-D ``weight`` [experts, out, in] and its forward, given
    rows grouped by expert and the rows per expert (``forward(inputs, sizes)``), applies each
    expert's weight to its rows: checked numerically once per class (on the meta device, on a
    copy holding small random weights of as many experts)."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 3 or next(module.children(), None) is not None:
        return False
    held = {n for n, _ in module.named_parameters()} | {n for n, _ in module.named_buffers()}
    if held != {"weight"}:
        return False
    cls = type(module)
    if cls not in _VERDICTS:
        if weight.is_meta:
            module = copy.deepcopy(module)
            module.weight = nn.Parameter(torch.empty(weight.shape[0], 4, 5, dtype=torch.float64).normal_())
        _VERDICTS[cls] = _applies_each_expert(module, module.weight)
    return _VERDICTS[cls]


def _applies_each_expert(module: nn.Module, weight: torch.Tensor) -> bool:
    experts, _, width = weight.shape
    sizes = [ROWS_PER_EXPERT[i % 2] for i in range(experts)]
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(sum(sizes), width, generator=generator, dtype=torch.float64).to(weight.device, weight.dtype)
    with torch.no_grad():
        try:
            own = module(x, sizes)
        except Exception:  # noqa: BLE001 - a forward that cannot take (rows, sizes) is not one
            return False
        expected = torch.cat([F.linear(rows, weight[i]) for i, rows in enumerate(x.split(sizes))])
    from torchpp.tensor_parallel.tp_forwards import SAME_FORWARD_RTOL  # (it imports this module)

    rtol = SAME_FORWARD_RTOL.get(weight.dtype, 1e-2)
    return isinstance(own, torch.Tensor) and own.shape == expected.shape and \
        torch.allclose(own, expected, rtol=rtol, atol=rtol * float(expected.abs().max()))


def split_expert_linear(module: nn.Module, ctx, column: bool) -> None:
    """Hooks the f (column split: on the rows entering) or the g (row split: on the partial
    outputs) around an expert linear whose weight is already this rank's shard."""
    from torchpp.tensor_parallel.hook_styles import _first_arg_hook, _map_first_output  # (they import this module)

    group = ctx.group
    if column:  # the rows entering: the forward's first argument, given by position or by name
        first = next(iter(inspect.signature(module.forward).parameters), "inputs")
        enter = _first_arg_hook(lambda rows: ops.copy_to_tp_region(rows, group), names=(first,))
        ctx.hooks.append(module.register_forward_pre_hook(enter, with_kwargs=True))
    else:
        ctx.hooks.append(module.register_forward_hook(_map_first_output(lambda y: ops.reduce_from_tp_region(y, group))))
