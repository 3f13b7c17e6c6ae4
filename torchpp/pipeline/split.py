"""split_model: cut a sequential model into pipeline stages by module name, without tracing."""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from torch import nn


def _blocks(model: nn.Module, split_points: Sequence[str]) -> List[Tuple[str, nn.Module]]:
    """The model's children in order, expanding every container that holds a split point."""
    blocks: List[Tuple[str, nn.Module]] = []

    def expand(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            full = f"{prefix}{name}"
            if any(point.startswith(full + ".") for point in split_points) or (
                not split_points and isinstance(child, (nn.ModuleList, nn.Sequential))
            ):
                expand(full + ".", child)
            else:
                blocks.append((full, child))

    expand("", model)
    return blocks


class StageSequential(nn.Sequential):
    """``nn.Sequential`` whose children may pass several tensors: a tuple a child returns
    becomes the next child's positional arguments, as between pipeline stages. Keyword
    arguments go to the first child (the first stage's further step arguments)."""

    def forward(self, *args, **kwargs):
        for index, module in enumerate(self):
            out = module(*args, **kwargs) if index == 0 else module(*args)
            args = out if isinstance(out, tuple) else (out,)
        return args[0] if len(args) == 1 else args

    def __prepare_scriptable__(self) -> nn.Sequential:
        # torch.jit.script takes this instead: TorchScript has no *args; one value per child.
        return nn.Sequential(*self)


def split_model(model: nn.Module, num_stages: int,
                split_points: Optional[Sequence[str]] = None) -> List[StageSequential]:
    """Cuts ``model`` into ``num_stages`` sequential parts (``StageSequential``) sharing its modules.

    The model's forward must apply its children in registration order, each feeding the next
    (embedding, blocks of a ModuleList, norm, head, ...); a child that returns a tuple feeds
    the next one its entries as positional arguments. A split point names the module that
    begins a new stage (``"layers.4"``); without split points the blocks are divided evenly,
    expanding ModuleList/Sequential children.

    Args:
        model: the model to cut (its modules are shared, not copied).
        num_stages: number of parts; equals ``len(split_points) + 1`` when points are given.
        split_points: names of the modules that start stages 1, 2, ...
    """
    points = list(split_points or [])
    if points and len(points) != num_stages - 1:
        raise ValueError(f"torchpp.split_model: {len(points)} split points make {len(points) + 1} stages, not {num_stages}")
    blocks = _blocks(model, points)
    names = [name for name, _ in blocks]
    if points:
        missing = [p for p in points if p not in names]
        if missing:
            raise ValueError(f"torchpp.split_model: split points {missing} are not modules in order; blocks are {names}")
        cuts = [names.index(p) for p in points]
        if cuts != sorted(cuts) or len(set(cuts)) != len(cuts) or cuts[0] == 0:
            raise ValueError(f"torchpp.split_model: split points {points} must be increasing and after the first block")
    else:
        if len(blocks) < num_stages:
            raise ValueError(f"torchpp.split_model: {len(blocks)} blocks cannot make {num_stages} stages")
        cuts = [round(k * len(blocks) / num_stages) for k in range(1, num_stages)]
    bounds = [0] + cuts + [len(blocks)]
    return [StageSequential(*[module for _, module in blocks[a:b]]) for a, b in zip(bounds, bounds[1:])]
