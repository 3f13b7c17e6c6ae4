"""The base of every tensor-parallel style (``torchpp.tensor_parallel.styles`` has the registry)."""
from __future__ import annotations

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
