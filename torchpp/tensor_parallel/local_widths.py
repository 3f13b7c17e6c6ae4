"""``local_widths(a, ...)``: a module holding column-split linears whose forward builds tensors of
their whole output width from integer attributes (JetMoE's mixture of attention heads: ``zeros(rows,
self.hidden_size)`` receives its query experts' output) gets those attributes divided by the TP
size, so it builds this rank's width. plan="auto" finds which attributes by trying them
(``torchpp.models.auto_check``); a plan names them like any style."""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

from torch import nn

from torchpp.tensor_parallel.sharding import PlanError, TPContext
from torchpp.tensor_parallel.style_base import Style, names_of_style, style_with_names

STYLE = "local_widths"


def local_widths_style(names: Sequence[str]) -> str:
    """The style name dividing the attributes ``names``: ``local_widths(hidden_size)``."""
    return style_with_names(STYLE, names)


def parse_local_widths_style(style: str) -> Optional[Tuple[str, ...]]:
    """The attribute names of a ``local_widths(...)`` style name; None for any other style."""
    return names_of_style(STYLE, style)


def divide_widths(module: nn.Module, names: Sequence[str], size: int, where: str) -> None:
    """Divides ``module``'s integer attributes ``names`` by ``size``; one missing, not an integer
    or not divisible raises, naming it and its value."""
    if not names:
        raise PlanError(f"torchpp plan: style {local_widths_style(names)!r} on {where} names no attribute")
    for name in names:
        value = getattr(module, name, None)
        if not isinstance(value, int) or isinstance(value, bool):
            raise PlanError(f"torchpp plan: {where}.{name} is {value!r}; style {STYLE!r} divides integer widths")
        if value % size:
            raise PlanError(f"torchpp plan: {where}.{name} = {value}, which tp={size} does not divide")
        setattr(module, name, value // size)


class LocalWidths(Style):
    def __init__(self, names: Sequence[str]):
        self.names = tuple(names)
        self.name = local_widths_style(self.names)

    def apply(self, module: nn.Module, name: str, ctx: TPContext) -> None:
        divide_widths(module, self.names, ctx.size, name)


def local_widths_style_of(style: str) -> Optional[Style]:
    """The style a ``local_widths(...)`` name stands for (None for another name)."""
    names = parse_local_widths_style(style)
    return None if names is None else LocalWidths(names)
