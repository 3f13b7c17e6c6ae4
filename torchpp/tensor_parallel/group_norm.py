"""The gated RMS norm of Mamba 2 mixers under TP (style ``gated_group_rmsnorm``).

transformers' Mamba 2 mixers (Mamba 2, Bamba, Nemotron-H, Granite hybrid, Zamba 2) normalise
``x * silu(gate)`` over each group of ``group_size`` channels, one group per group of heads, then
scale by a per-channel weight. The weight splits by channels with the heads. Where each rank holds
whole groups (tp divides n_groups) the module runs unchanged on its channels. Where the ranks
outnumber the groups (n_groups=1 in Bamba, Granite 4 and Zamba 2), a group spans several ranks: each
rank's sum of squares over its part is summed over the ranks sharing its group (all-reduce forward
and backward: each rank's output depends on the others' channels), as vLLM's Mamba 2 norm does.
"""
from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

from torchpp import ops
from torchpp.tensor_parallel.layouts import Split
from torchpp.tensor_parallel.sharding import PlanError, TPContext, full_shape, shard_parameter
from torchpp.tensor_parallel.styles import Style
from torchpp.tensor_parallel.utils import through_slot


def sum_over_group(local: torch.Tensor, group, slot: int, slots: int) -> torch.Tensor:
    """``local`` summed over the ranks of TP slot ``slot`` of ``slots`` (consecutive ranks sharing a
    group of channels), forward and backward: g then f on its slot of a zero-padded row."""
    return through_slot(local, slot, slots,
                        lambda row: ops.copy_to_tp_region(ops.reduce_from_tp_region(row, group), group))


def _forward_over_ranks(self, hidden_states: torch.Tensor, gate=None) -> torch.Tensor:
    # transformers' gated group norm, its group's sum of squares taken over the ranks holding it;
    # Falcon-H1's may gate after the norm and scales before casting back.
    input_dtype, gate_after = hidden_states.dtype, getattr(self, "norm_before_gate", None)
    hidden_states = hidden_states.to(torch.float32)
    if gate is not None and not gate_after:
        hidden_states = hidden_states * F.silu(gate.to(torch.float32))
    squares = sum_over_group(hidden_states.pow(2).sum(-1, keepdim=True), *self.tp_group_slot)
    hidden_states = hidden_states * torch.rsqrt(squares / self.tp_group_channels + self.variance_epsilon)
    if gate_after is None:
        return self.weight * hidden_states.to(input_dtype)
    hidden_states = self.weight * hidden_states
    if gate is not None and gate_after:
        hidden_states = hidden_states * F.silu(gate.to(torch.float32))
    return hidden_states.to(input_dtype)


def norm_groups(module: nn.Module, channels: int):
    """How many groups the norm's channels form: ``group_size`` wide each (Mamba 2's), or
    ``n_groups`` of them (Falcon-H1's); None for another module."""
    if isinstance(getattr(module, "group_size", None), int):
        return channels // module.group_size if channels % module.group_size == 0 else None
    n_groups = getattr(module, "n_groups", None)
    return n_groups if isinstance(n_groups, int) and n_groups > 0 and channels % n_groups == 0 else None


class GatedGroupRMSNorm(Style):
    """Weight split by channels; the group's statistics summed over the ranks sharing it."""

    name = "gated_group_rmsnorm"

    def apply(self, module: nn.Module, name: str, ctx: TPContext) -> None:
        weight = getattr(module, "weight", None)
        channels = full_shape(weight, ctx)[0] if isinstance(weight, nn.Parameter) and weight.dim() == 1 else None
        groups = norm_groups(module, channels) if channels else None
        if groups is None or not hasattr(module, "variance_epsilon"):
            raise PlanError(f"torchpp plan: style {self.name!r} applies to a gated RMS norm over groups of channels "
                            f"(weight, group_size or n_groups, variance_epsilon), but {name} is {type(module).__name__}")
        if channels % ctx.size or (groups % ctx.size and ctx.size % groups):
            raise PlanError(f"torchpp plan: {name}: {channels} channels in {groups} groups do not split over "
                            f"tp={ctx.size} (it must divide the channels, and divide the groups or be a multiple of them)")
        shard_parameter(weight, Split(0, channels), ctx, f"{name}.weight")
        if groups < ctx.size:  # a group spans ranks
            replicas = ctx.size // groups
            module.tp_group_slot = (ctx.group, ctx.rank // replicas, groups)
            module.tp_group_channels = channels // groups
            module.forward = types.MethodType(_forward_over_ranks, module)
        elif not hasattr(module, "group_size"):  # whole groups here: Falcon-H1's norm views n_groups of them
            module.n_groups = groups // ctx.size
