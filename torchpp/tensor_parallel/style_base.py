"""The base of every tensor-parallel style (``torchpp.tensor_parallel.styles`` has the registry)."""
from __future__ import annotations

import re
from typing import Optional, Sequence, Tuple

import torch
from torch import nn

from torchpp.tensor_parallel.sharding import PlanError, TPContext


class Style:
    """A TP style. ``apply`` shards a module and gives it its TP forward; ``apply_param`` shards a
    bare parameter named by the plan (e.g. a fused expert tensor)."""

    name = ""

    def apply(self, module: nn.Module, name: str, ctx: TPContext) -> None:
        raise PlanError(f"torchpp plan: style {self.name!r} applies to parameters, but {name} is a "
                        f"{type(module).__name__} module")

    def apply_param(self, module: nn.Module, param_name: str, name: str, ctx: TPContext) -> None:
        raise PlanError(f"torchpp plan: style {self.name!r} applies to modules, but {name} is a parameter")

    def local_value(self, param: torch.Tensor, param_name: str, rank: int, size: int) -> torch.Tensor:
        """What TP rank ``rank`` of ``size`` computes with in place of the bare parameter ``param``
        (plan="auto"'s trials simulate the ranks with it): its shard."""
        return self.param_layout(param, param_name).shard(param.detach(), rank, size)


def style_with_names(stem: str, names: Sequence[str]) -> str:
    """The name of a style parameterised by names: ``split_head_inputs(alibi,attention_mask)``."""
    return f"{stem}({','.join(names)})"


def names_of_style(stem: str, style: str) -> Optional[Tuple[str, ...]]:
    """The names in a ``stem(a, ...)`` style name; None for any other style."""
    match = re.fullmatch(rf"{stem}\(([\w\s,]*)\)", style)
    return None if match is None else tuple(name.strip() for name in match.group(1).split(",") if name.strip())
