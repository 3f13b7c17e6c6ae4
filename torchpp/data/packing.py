"""Packing documents into fixed-length rows, with position ids that restart at each document.

Documents are concatenated, each followed by EOS, and cut into rows of `seq_len` tokens (the
tail that does not fill a row is dropped). A token's position id counts from the start of its
document or of its row, whichever is later, so positions restart at every document boundary:
transformers then masks attention within each document (its packed-sequence mask), and
context parallelism takes the same boundaries from the same position ids.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass
class PackedRows:
    """Packed token rows.

    Attributes:
        input_ids: [rows, seq_len] int64 tokens (labels are the same ids: the model shifts them).
        position_ids: [rows, seq_len] int64, restarting at every document and row start.
        documents: how many documents went in.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    documents: int

    def __len__(self) -> int:
        return self.input_ids.size(0)

    @property
    def tokens(self) -> int:
        return self.input_ids.numel()


def pack_documents(token_lists: Sequence[Sequence[int]], seq_len: int, eos_id: int) -> PackedRows:
    """Packs tokenized documents into rows of `seq_len` tokens (see the module docstring).

    Args:
        token_lists: each document's token ids.
        seq_len: tokens per row.
        eos_id: appended to every document.
    """
    if seq_len < 2:
        raise ValueError(f"torchpp.data: seq_len {seq_len} must be at least 2")
    lengths = torch.tensor([len(t) + 1 for t in token_lists], dtype=torch.int64)
    ids = torch.tensor([i for tokens in token_lists for i in (*tokens, eos_id)], dtype=torch.int64)
    rows = ids.numel() // seq_len
    if rows == 0:
        raise ValueError(f"torchpp.data: {ids.numel()} tokens do not fill one row of {seq_len}")
    index = torch.arange(rows * seq_len)
    doc_start = torch.repeat_interleave(torch.cumsum(lengths, 0) - lengths, lengths)[: rows * seq_len]
    row_start = index - index % seq_len
    positions = index - torch.maximum(doc_start, row_start)
    return PackedRows(ids[: rows * seq_len].view(rows, seq_len), positions.view(rows, seq_len), len(token_lists))
