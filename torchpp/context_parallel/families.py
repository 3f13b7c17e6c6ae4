"""A module's entry in a table of model families keyed by modeling module and class name
("modeling_falcon.FalconAttention"): the first of its classes (its own, then its bases, as flash or
model-specific variants subclass them) that the table names."""
from __future__ import annotations

from typing import Mapping, Optional, TypeVar

from torch import nn

T = TypeVar("T")


def lookup(module: nn.Module, table: Mapping[str, T]) -> Optional[T]:
    for cls in type(module).__mro__:
        entry = table.get(f"{cls.__module__.rpartition('.')[2]}.{cls.__name__}")
        if entry is not None:
            return entry
    return None


def named_in(module: nn.Module, names) -> bool:
    """Whether one of the module's classes is in ``names`` (a collection of such keys)."""
    return lookup(module, {name: True for name in names}) is not None
