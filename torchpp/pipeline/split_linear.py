"""The split B/W linear: backward for inputs now (I), backward for weights later (W).

``split_bw_linear`` is ``F.linear`` whose backward, while the weight-gradient store captures a
(stage, microbatch), computes only the input gradient and parks the weight/bias gradient; the
pipeline's W pass (or ``weight_grad_store.run``) performs it later, accumulating into ``.grad``
exactly as an ordinary backward would. Outside a capture it is an ordinary linear.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

import torchpp  # noqa: F401  (registers torch.ops.torchpp)


# torch.compile would trace the op's backward ahead of time and compute the weight gradient in
# I; a graph break here keeps the op eager, so its C++ backward can still park it for W.
@torch.compiler.disable
def _eager_split_bw_linear(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return torch.ops.torchpp.split_bw_linear(input, weight, bias)


def split_bw_linear(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``y = input @ weight.T + bias`` with a weight gradient the pipeline can defer (under
    ``torch.compile`` too: the compiled graph breaks around it)."""
    if torch.compiler.is_compiling():
        return _eager_split_bw_linear(input, weight, bias)
    return torch.ops.torchpp.split_bw_linear(input, weight, bias)  # eager: no disable wrapper per call


class SplitBWLinear(nn.Linear):
    """``nn.Linear`` (same parameters, same initialisation) backed by ``split_bw_linear``."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return split_bw_linear(input, self.weight, self.bias)
