"""How a parameter's TP shards relate to the unsharded tensor.

A sharded parameter carries a ``Layout`` (``param.tp_layout``): ``layout.shard(full, rank, size)``
cuts TP rank ``rank``'s shard out of the full tensor (loading a checkpoint, sharding a model in
place), and ``layout(shards)`` puts the full tensor back together from every rank's shard (saving,
comparing with the unwrapped model). One Layout class per way of cutting, composed where needed.
"""
from __future__ import annotations

import abc
from typing import List, Sequence, Tuple

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


class FusedQKV(Layout):
    """A fused query/key/value projection along ``dim``: ``num_heads`` query heads and
    ``num_kv_heads`` key and value heads, ``head_dim`` wide each, in blocks [q | k | v] or, when
    ``grouped``, per key/value head [its queries, k, v] (Falcon's new architecture). TP rank r
    holds its num_heads/size query heads and the key/value heads they read, arranged alike: its
    num_kv_heads/size of them, or, with more ranks than key/value heads, a copy of the one its
    query heads share (as Megatron-LM replicates them). One copy of each row makes the full tensor."""

    def __init__(self, dim: int, head_dim: int, num_heads: int, num_kv_heads: int, grouped: bool = False):
        self.dim, self.head_dim, self.num_heads, self.num_kv_heads = dim, head_dim, num_heads, num_kv_heads
        self.grouped = grouped

    def copies(self, size: int) -> int:
        """On how many ranks each key/value head sits."""
        return max(1, size // self.num_kv_heads)

    def copied_features(self, size: int) -> int:
        """How many of a rank's last output features are copies of key/value heads (0: none copied)."""
        return 2 * self.head_dim if self.copies(size) > 1 else 0

    def copy_slot(self, rank: int, size: int) -> Tuple[int, int, bool]:
        """(which key/value head rank ``rank`` holds a copy of, how many heads are copied, whether
        its copy is the head's first)."""
        copies = self.copies(size)
        return (rank // copies, self.num_kv_heads, rank % copies == 0) if copies > 1 else (0, 1, True)

    def uncounted(self, rank: int, size: int) -> range:
        """The rows of rank ``rank``'s shard along ``dim`` that another rank's copy counts (a norm counts each once)."""
        copied = self.copied_features(size)
        local = (self.num_heads // size) * self.head_dim + copied
        return range(local - copied, local) if rank % self.copies(size) else range(0)

    def check(self, size: int) -> None:
        """Raises ValueError naming the head counts where ``size`` ranks cannot split them."""
        heads, kv = self.num_heads, self.num_kv_heads
        if heads % size or heads % kv or (kv % size and size % kv):
            raise ValueError(f"torchpp: num_heads={heads} with num_kv_heads={kv} do not split over the tensor-parallel "
                             f"size {size} (it must divide num_heads, and divide num_kv_heads or be a multiple of it)")

    def _rows(self, rank: int, size: int) -> torch.Tensor:
        """Where rank ``rank``'s rows sit in the full tensor, in the shard's order."""
        heads, kv = self.num_heads, self.num_kv_heads
        per_group = heads // kv
        if self.grouped:  # slots of group g: [g * (per_group + 2), ...): its queries, then k, then v
            query = lambda h: h // per_group * (per_group + 2) + h % per_group  # noqa: E731
            key = lambda j: j * (per_group + 2) + per_group  # noqa: E731
        else:
            query, key = (lambda h: h), (lambda j: heads + j)
        value = lambda j: key(j) + (1 if self.grouped else kv)  # noqa: E731
        queries = range(rank * heads // size, (rank + 1) * heads // size)
        kv_heads = range(rank * kv // size, (rank + 1) * kv // size) if kv >= size else [rank * kv // size]
        if self.grouped:
            slots = [s for j in kv_heads for s in [query(h) for h in queries if h // per_group == j] + [key(j), value(j)]]
        else:
            slots = [query(h) for h in queries] + [key(j) for j in kv_heads] + [value(j) for j in kv_heads]
        return (torch.tensor(slots).unsqueeze(1) * self.head_dim + torch.arange(self.head_dim)).flatten()

    def full_shape(self, local_shape, size):
        shape = list(local_shape)
        shape[self.dim] = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        return torch.Size(shape)

    def __call__(self, shards):
        size = len(shards)
        full = shards[0].new_empty(self.full_shape(shards[0].shape, size))
        for rank in reversed(range(size)):  # a key/value head's first copy is written last
            full.index_copy_(self.dim, self._rows(rank, size).to(full.device), shards[rank])
        return full

    def shard(self, full, rank, size):
        self.check(size)
        expected = self.full_shape(full.shape, size)[self.dim]
        if full.size(self.dim) != expected:
            raise ValueError(f"torchpp: a fused query/key/value tensor of size {full.size(self.dim)} along dim "
                             f"{self.dim} where {expected} was expected")
        return full.index_select(self.dim, self._rows(rank, size).to(full.device))

    def __repr__(self) -> str:
        return (f"FusedQKV(dim={self.dim}, head_dim={self.head_dim}, num_heads={self.num_heads}, "
                f"num_kv_heads={self.num_kv_heads}{', grouped' if self.grouped else ''})")
