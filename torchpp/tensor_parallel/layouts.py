"""How a parameter's TP shards relate to the unsharded tensor.

A sharded parameter carries a ``Layout`` (``param.tp_layout``): ``layout.shard(full, rank, size)``
cuts TP rank ``rank``'s shard out of the full tensor (loading a checkpoint, sharding a model in
place), and ``layout(shards)`` puts the full tensor back together from every rank's shard (saving,
comparing with the unwrapped model). One Layout class per way of cutting, composed where needed.
"""
from __future__ import annotations

import abc
from typing import List, Sequence

import torch


class Layout(abc.ABC):
    """How one parameter's TP shards (in TP-rank order) relate to the full tensor."""

    #: the dim split over TP ranks (None: every rank holds the whole tensor)
    dim = None

    @abc.abstractmethod
    def __call__(self, shards: List[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every TP rank's shard."""

    @abc.abstractmethod
    def shard(self, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
        """TP rank ``rank``'s shard of ``full`` over ``size`` ranks."""

    def full_shape(self, local_shape: Sequence[int], size: int) -> torch.Size:
        """The full tensor's shape, from a shard's."""
        return self([torch.empty(local_shape, device="meta")] * size).shape


class Replicated(Layout):
    """Every TP rank holds the whole tensor."""

    def __call__(self, shards):
        return shards[0]

    def shard(self, full, rank, size):
        return full

    def __repr__(self) -> str:
        return "Replicated()"


class Split(Layout):
    """Contiguous equal pieces along ``dim``; the full tensor is padded with zeros up to a
    multiple of the TP size when ``pad`` (vocabularies), and trimmed back when reassembled."""

    def __init__(self, dim: int, full_size: int, pad: bool = False):
        self.dim, self.full_size, self.pad = dim, full_size, pad

    def __call__(self, shards):
        return torch.cat(shards, dim=self.dim).narrow(self.dim, 0, self.full_size)

    def shard(self, full, rank, size):
        dim = self.dim % full.dim()
        if full.size(dim) != self.full_size:
            raise ValueError(f"torchpp: a tensor of size {full.size(dim)} along dim {dim} where {self.full_size} "
                             f"was expected")
        padded = -(-self.full_size // size) * size if self.pad else self.full_size
        if padded % size:
            raise ValueError(f"torchpp: size {self.full_size} along dim {dim} is not divisible by the "
                             f"tensor-parallel size {size}")
        if padded != self.full_size:
            shape = list(full.shape)
            shape[dim] = padded - self.full_size
            full = torch.cat([full, full.new_zeros(shape)], dim=dim)
        piece = padded // size
        return full.narrow(dim, rank * piece, piece)

    def __repr__(self) -> str:
        return f"Split(dim={self.dim}, full_size={self.full_size}{', pad' if self.pad else ''})"


def _regroup(t: torch.Tensor, sizes: Sequence[int], size: int, dim: int) -> torch.Tensor:
    # [a; b; ...] -> [a_0 b_0 ...; a_1 b_1 ...; ...]: rank r's piece along dim holds its slice of each block.
    parts = [block.chunk(size, dim) for block in t.split(list(sizes), dim)]
    return torch.cat([chunks[rank] for rank in range(size) for chunks in parts], dim)


class Packed(Layout):
    """A fused tensor of blocks along ``dim`` ([gate; up], [q; k; v]) split block by block: TP
    rank r holds its slice of every block, in block order, so the module's own ``chunk`` /
    ``split`` of its output works on each rank's slice."""

    def __init__(self, dim: int, blocks: Sequence[int]):
        self.dim, self.blocks = dim, list(blocks)

    def __call__(self, shards):
        size = len(shards)
        local = [b // size for b in self.blocks]
        pieces = [shard.split(local, self.dim) for shard in shards]
        return torch.cat([torch.cat([p[block] for p in pieces], self.dim) for block in range(len(self.blocks))],
                         self.dim)

    def shard(self, full, rank, size):
        for block in self.blocks:
            if block % size:
                raise ValueError(f"torchpp: the tensor-parallel size {size} does not divide each fused block "
                                 f"{self.blocks} along dim {self.dim}")
        piece = sum(self.blocks) // size
        return _regroup(full, self.blocks, size, self.dim).narrow(self.dim, rank * piece, piece)

    def __repr__(self) -> str:
        return f"Packed(dim={self.dim}, blocks={self.blocks})"


class HeadCopies(Layout):
    """Heads along ``dim`` (``head_dim`` wide each) fewer than the TP ranks: each head is copied
    onto ``replicas`` consecutive ranks (key/value heads under GQA when tp exceeds them); one
    copy of each makes the full tensor."""

    def __init__(self, dim: int, head_dim: int, replicas: int):
        self.dim, self.head_dim, self.replicas = dim, head_dim, replicas

    def __call__(self, shards):
        return torch.cat(shards[:: self.replicas], dim=self.dim)

    def shard(self, full, rank, size):
        heads = size // self.replicas
        piece = full.size(self.dim) // heads
        return full.narrow(self.dim, rank // self.replicas * piece, piece)

    def __repr__(self) -> str:
        return f"HeadCopies(dim={self.dim}, head_dim={self.head_dim}, replicas={self.replicas})"
