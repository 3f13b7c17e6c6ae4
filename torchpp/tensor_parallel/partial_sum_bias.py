"""``partial_sum_bias``: a bias that a module split over TP adds before its partial outputs are
summed (g), not after: an experts module adds each expert's down bias before the routing weight
scales it, so it cannot move past the sum as a row-split linear's does. Each rank adds bias / tp
(the parameter stays whole and identical on every rank, so checkpoints and optimizers see one
tensor); the sum over the ranks then holds the bias once, and the gradient each rank gets, 1/tp of
the whole, is summed over TP. Division and sum are exact for power-of-two TP sizes."""
from __future__ import annotations

import torch
from torch import nn

from torchpp.tensor_parallel.sharding import sum_grads_over_tp
from torchpp.tensor_parallel.style_base import Style


class PartialSumBias(Style):
    name = "partial_sum_bias"

    def apply_param(self, module: nn.Module, param_name: str, name: str, ctx) -> None:
        param, size = getattr(module, param_name), ctx.size
        sum_grads_over_tp(param, ctx)

        # The module's forward reads the attribute: it holds bias / tp for the forward only (a
        # non-leaf of the parameter, so the gradient reaches the parameter), then the parameter again.
        def divide(module, args):
            module._parameters[param_name] = param / size

        def restore(module, args, output):
            module._parameters[param_name] = param

        ctx.hooks.append(module.register_forward_pre_hook(divide))
        ctx.hooks.append(module.register_forward_hook(restore, always_call=True))  # a forward that raised too

    def local_value(self, param: torch.Tensor, param_name: str, rank: int, size: int) -> torch.Tensor:
        return param.detach() / size
