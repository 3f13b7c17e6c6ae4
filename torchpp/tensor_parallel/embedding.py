"""Vocabulary-parallel embedding: each TP rank holds a contiguous range of the vocabulary."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from torchpp import ops
from torchpp.tensor_parallel.utils import check_same_device, divide, mark_tensor_parallel


def padded_vocab_size(vocab_size: int, tp_size: int) -> int:
    """The smallest multiple of ``tp_size`` that holds ``vocab_size`` rows."""
    return -(-vocab_size // tp_size) * tp_size


def pad_rows(table: torch.Tensor, rows: int) -> torch.Tensor:
    """``table`` with zero rows appended up to ``rows`` (itself when it already has them)."""
    if table.size(0) == rows:
        return table
    return torch.cat([table, table.new_zeros(rows - table.size(0), *table.shape[1:])])


class VocabParallelEmbedding(nn.Module):
    """nn.Embedding with rows split over the TP group.

    Each rank looks up the ids in its vocabulary range, zeros the others, and the partial
    results are summed over the group (all-reduce, or reduce-scatter along the sequence with
    sequence_parallel).

    Args:
        num_embeddings: vocabulary size; divided by the TP size (see ``pad_vocab``).
        embedding_dim: embedding size.
        padding_idx: as in nn.Embedding (its row gets no gradient).
        sequence_parallel: return this rank's slice of ``sequence_dim`` (reduce-scatter).
        sequence_dim: the sequence dimension of the output (0 for [s, b, h]).
        group: the TP ProcessGroup, its name, or None for the default group.
        init_method: initialises the full table (default: nn.Embedding's normal_).
        pad_vocab: when the TP size does not divide ``num_embeddings``, pad the table with
            zero rows up to the next multiple (``padded_num_embeddings``); ids never reach
            the padding, and an output layer tied to this table must mask its padded logits
            (``vocab_parallel_cross_entropy(..., vocab_size=num_embeddings)``).
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: Optional[int] = None,
        *,
        sequence_parallel: bool = False,
        sequence_dim: int = 0,
        group: ops.GroupLike = None,
        init_method=None,
        device=None,
        dtype=None,
        pad_vocab: bool = False,
    ):
        super().__init__()
        self.group = ops.group_of(group)
        self.tp_size = self.group.size()
        self.tp_rank = dist.get_rank(self.group)
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.padded_num_embeddings = padded_vocab_size(num_embeddings, self.tp_size) if pad_vocab else num_embeddings
        self.num_embeddings_per_rank = divide(
            self.padded_num_embeddings, self.tp_size, "VocabParallelEmbedding num_embeddings"
        )
        self.vocab_start = self.tp_rank * self.num_embeddings_per_rank
        self.vocab_end = self.vocab_start + self.num_embeddings_per_rank
        if padding_idx is not None and padding_idx < 0:
            padding_idx += num_embeddings
        self.padding_idx = padding_idx
        self.sequence_parallel = sequence_parallel
        self.sequence_dim = sequence_dim
        full = torch.empty(num_embeddings, embedding_dim, device=device, dtype=dtype)
        (init_method or nn.init.normal_)(full)
        if padding_idx is not None:
            with torch.no_grad():
                full[padding_idx].zero_()
        full = pad_rows(full, self.padded_num_embeddings)
        self.weight = nn.Parameter(full[self.vocab_start : self.vocab_end].clone())
        mark_tensor_parallel(self.weight, partition_dim=0, group_size=self.tp_size)

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, **kwargs) -> "VocabParallelEmbedding":
        """Shards an existing nn.Embedding over the TP group, keeping its values."""
        layer = cls(
            embedding.num_embeddings, embedding.embedding_dim, embedding.padding_idx,
            init_method=nn.init.zeros_, device=embedding.weight.device, dtype=embedding.weight.dtype, **kwargs,
        )
        with torch.no_grad():
            padded = pad_rows(embedding.weight, layer.padded_num_embeddings)
            layer.weight.copy_(padded[layer.vocab_start : layer.vocab_end])
        return layer

    def _local_padding_idx(self) -> Optional[int]:
        if self.padding_idx is not None and self.vocab_start <= self.padding_idx < self.vocab_end:
            return self.padding_idx - self.vocab_start
        return None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        check_same_device(input_ids, self.weight, "VocabParallelEmbedding")
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local_ids = (input_ids - self.vocab_start).masked_fill(outside, 0)
        partial = F.embedding(local_ids, self.weight, self._local_padding_idx())
        partial = partial.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return ops.reduce_scatter_to_sp_region(partial, self.group, dim=self.sequence_dim)
        return ops.reduce_from_tp_region(partial, self.group)

    def extra_repr(self) -> str:
        padded = f" padded to {self.padded_num_embeddings}" if self.padded_num_embeddings != self.num_embeddings else ""
        return (
            f"{self.num_embeddings}{padded} ({self.num_embeddings_per_rank} per rank), {self.embedding_dim}, "
            f"tp={self.tp_size}, sequence_parallel={self.sequence_parallel}"
        )
