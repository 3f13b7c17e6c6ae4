"""Rectangular chunks of a global tensor, for state that is not a rectangular shard.

A ZeRO-1 shard holds a contiguous range of a flattened (TP-local) parameter. DCP describes
stored data as rectangles (offsets, sizes) of a tensor, so the range is cut into the few
rectangles that tile it; each is a contiguous piece of the range, hence a view of the shard.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Sequence, Tuple

import torch


@dataclass(frozen=True)
class Box:
    """A rectangle of a row-major tensor that is also a contiguous range of its flattening."""

    offsets: Tuple[int, ...]
    sizes: Tuple[int, ...]
    flat_start: int  # index of the box's first element in the flattened tensor

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


def flat_range_boxes(shape: Sequence[int], lo: int, hi: int) -> List[Box]:
    """The rectangles, in order, that tile elements [lo, hi) of a row-major tensor of `shape`.

    Args:
        shape: the tensor's shape.
        lo: first flat index of the range.
        hi: one past the last flat index of the range.

    Returns:
        At most 2 * len(shape) - 1 boxes (a partial row, full rows, a partial row, per dim).
    """
    shape = tuple(shape)
    if not 0 <= lo <= hi <= math.prod(shape):
        raise ValueError(f"torchpp.checkpoint: range [{lo}, {hi}) outside a tensor of shape {shape}")
    if lo == hi:
        return []
    if not shape:
        return [Box((), (), 0)]
    inner = math.prod(shape[1:])
    first, last = lo // inner, (hi - 1) // inner
    if first == last:  # inside one row: recurse into it
        return [
            Box((first,) + b.offsets, (1,) + b.sizes, first * inner + b.flat_start)
            for b in flat_range_boxes(shape[1:], lo - first * inner, hi - first * inner)
        ]
    boxes: List[Box] = []
    full_lo, full_hi = -(-lo // inner), hi // inner  # rows entirely inside the range
    if lo < full_lo * inner:
        boxes += flat_range_boxes(shape, lo, full_lo * inner)
    if full_lo < full_hi:
        boxes.append(Box((full_lo,) + (0,) * (len(shape) - 1), (full_hi - full_lo,) + shape[1:], full_lo * inner))
    if full_hi * inner < hi:
        boxes += flat_range_boxes(shape, full_hi * inner, hi)
    return boxes


@dataclass
class ChunkedTensor:
    """This rank's rectangles of a global tensor, each with the local tensor holding it.

    Args:
        global_shape: shape of the whole (unsharded) tensor.
        offsets: per chunk, its offset in the global tensor.
        tensors: per chunk, its data (shape = the chunk's sizes); loads write into them.
    """

    global_shape: torch.Size
    offsets: List[torch.Size]
    tensors: List[torch.Tensor]

    @classmethod
    def from_flat_range(
        cls, flat: torch.Tensor, local_shape: Sequence[int], lo: int, global_shape: Sequence[int], shift: Sequence[int]
    ) -> "ChunkedTensor":
        """Chunks for `flat`, elements [lo, lo + flat.numel()) of a flattened local tensor
        that sits at offset `shift` inside the global tensor.

        Args:
            flat: 1-D tensor holding the range (the chunks are views of it).
            local_shape: shape of the local tensor (e.g. the TP shard of a parameter).
            lo: flat index in the local tensor where `flat` starts.
            global_shape: shape of the global tensor.
            shift: offset of the local tensor inside the global one.
        """
        boxes = flat_range_boxes(local_shape, lo, lo + flat.numel())
        offsets = [torch.Size(o + s for o, s in zip(b.offsets, shift)) for b in boxes]
        tensors = [flat[b.flat_start - lo : b.flat_start - lo + b.numel].view(b.sizes) for b in boxes]
        return cls(torch.Size(global_shape), offsets, tensors)
