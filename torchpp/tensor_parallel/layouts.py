"""How a parameter's TP shards relate to the unsharded tensor.

A sharded parameter carries a ``Layout`` (``param.tp_layout``): ``layout.shard(full, rank, size)``
cuts TP rank ``rank``'s shard out of the full tensor (loading a checkpoint, sharding a model in
place), and ``layout(shards)`` puts the full tensor back together from every rank's shard (saving,
comparing with the unwrapped model). One Layout class per way of cutting, composed where needed.
"""
from __future__ import annotations

import abc
from typing import List, Optional, Sequence, Tuple

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


class Packed(Layout):
    """A fused tensor of blocks along ``dim`` ([gate; up], [q; k; v]) split block by block: TP
    rank r holds its slice of every block, in block order, so the module's own ``chunk`` /
    ``split`` of its output works on each rank's slice.

    ``groups[i]`` > 0 says block i is that many equal groups (Mamba 2's B and C, one per group of
    heads): where the ranks outnumber them, each rank holds its group whole, copied onto
    ``size // groups[i]`` consecutive ranks (as key/value heads are); one copy makes the full tensor.
    """

    def __init__(self, dim: int, blocks: Sequence[int], groups: Optional[Sequence[int]] = None):
        self.dim, self.blocks = dim, list(blocks)
        self.groups = list(groups) if groups is not None else [0] * len(self.blocks)

    def _replicas(self, block: int, size: int) -> int:
        """On how many ranks each piece of block ``block`` sits (1: split, not copied)."""
        groups = self.groups[block]
        return size // groups if groups and groups < size else 1

    def _local(self, size: int) -> List[int]:
        return [b * self._replicas(i, size) // size for i, b in enumerate(self.blocks)]

    def check(self, size: int) -> None:
        """Raises ValueError naming the blocks ``size`` ranks cannot split."""
        for block, groups in zip(self.blocks, self.groups):
            if groups and (block % groups or (groups % size and size % groups)):
                raise ValueError(f"torchpp: a fused block of {block} in {groups} groups does not split over the "
                                 f"tensor-parallel size {size} (it must divide the groups or be a multiple of them)")
            if not groups and block % size:
                raise ValueError(f"torchpp: the tensor-parallel size {size} does not divide each fused block "
                                 f"{self.blocks} along dim {self.dim}")

    def copied_rows(self, size: int) -> Optional[Tuple[int, int, int]]:
        """(start, stop, replicas) of the copied blocks' rows in a shard (None: nothing copied);
        they sit next to each other, copied onto as many ranks each."""
        local, rows, replicas = self._local(size), [], set()
        for i in range(len(self.blocks)):
            if self._replicas(i, size) > 1:
                rows.append((sum(local[:i]), sum(local[:i + 1])))
                replicas.add(self._replicas(i, size))
        if not rows:
            return None
        if len(replicas) > 1 or any(a[1] != b[0] for a, b in zip(rows, rows[1:])):
            raise ValueError(f"torchpp: the copied blocks of {self!r} must be adjacent and copied alike")
        return rows[0][0], rows[-1][1], replicas.pop()

    def uncounted(self, rank: int, size: int) -> range:
        """The rows of rank ``rank``'s shard that another rank's copy counts (a norm counts each once)."""
        copied = self.copied_rows(size)
        return range(copied[0], copied[1]) if copied is not None and rank % copied[2] else range(0)

    def __call__(self, shards):
        size = len(shards)
        pieces = [shard.split(self._local(size), self.dim) for shard in shards]
        return torch.cat([torch.cat([p[i] for p in pieces[::self._replicas(i, size)]], self.dim)
                          for i in range(len(self.blocks))], self.dim)

    def shard(self, full, rank, size):
        self.check(size)
        local = self._local(size)
        return torch.cat([block.narrow(self.dim, rank // self._replicas(i, size) * local[i], local[i])
                          for i, block in enumerate(full.split(self.blocks, self.dim))], self.dim)

    def __repr__(self) -> str:
        groups = f", groups={self.groups}" if any(self.groups) else ""
        return f"Packed(dim={self.dim}, blocks={self.blocks}{groups})"


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
