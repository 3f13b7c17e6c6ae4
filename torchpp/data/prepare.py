"""A job's text data, prepared once on rank 0 and shared: every rank gets the same packed rows.

Rank 0 reads the documents, trains or loads the tokenizer, splits off the held-out documents,
tokenizes and packs; the rows go to every rank in one broadcast, so the other ranks (and the
other nodes) need neither the files nor the tokenizer, and all of them see the same batches.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional

import torch.distributed as dist

from torchpp.checkpoint.directory import on_rank0
from torchpp.data.corpus import DEFAULT_CORPUS, default_corpus, read_documents, split_documents
from torchpp.data.packing import PackedRows, pack_documents
from torchpp.data.tokenizer import default_tokenizer, load_tokenizer, tokenize


@dataclass
class TextData:
    """Packed training and held-out rows, and where they came from.

    Attributes:
        train, held_out: the packed rows.
        vocab_size: the tokenizer's vocabulary (the model's embedding needs at least as many rows).
        description: one line saying what the text and tokenizer are (for the job's log).
        tokenizer: the tokenizer, on rank 0 only (None elsewhere), for saving next to a model.
    """

    train: PackedRows
    held_out: PackedRows
    vocab_size: int
    description: str
    tokenizer: Any = None


def _prepare(seq_len: int, data: Optional[str], tokenizer: Optional[str], vocab_size: int, held_out: float,
             text_field: str) -> TextData:
    start = time.perf_counter()
    documents = read_documents(data, text_field) if data else default_corpus()
    if tokenizer:
        tok, where = load_tokenizer(tokenizer), f"the tokenizer in {tokenizer}"
    else:
        tok, folder, trained = default_tokenizer(documents, vocab_size)
        where = f"a byte-level BPE of {len(tok)} tokens {'trained now and cached in' if trained else 'cached in'} {folder}"
    train_docs, held_docs = split_documents(documents, held_out)
    train = pack_documents(tokenize(tok, train_docs), seq_len, tok.eos_token_id)
    held = pack_documents(tokenize(tok, held_docs), seq_len, tok.eos_token_id)
    source = data or f"{DEFAULT_CORPUS} (CPython's documentation topics)"
    description = (f"text: {source}, {len(documents)} documents; {where}; {train.tokens} training tokens in "
                   f"{len(train)} rows of {seq_len}, {held.tokens} held-out tokens from {len(held_docs)} documents "
                   f"({time.perf_counter() - start:.1f}s)")
    return TextData(train, held, len(tok), description, tok)


def prepare_text(seq_len: int, data: Optional[str] = None, tokenizer: Optional[str] = None, vocab_size: int = 4096,
                 held_out: float = 0.05, text_field: str = "text") -> TextData:
    """The job's packed text on every rank (collective over the world; see the module docstring).

    Args:
        seq_len: tokens per row.
        data: a user's .txt/.jsonl/.parquet file or folder (read_documents); None: the
            embedded default corpus.
        tokenizer: a local transformers tokenizer folder; None: the byte-level BPE of the
            documents (default_tokenizer, trained at first use and cached).
        vocab_size: the BPE's vocabulary size when it is trained.
        held_out: the fraction of documents held out for evaluation.
        text_field: the text column of .jsonl and .parquet files.
    """
    kept = {}

    def on_rank_0() -> TextData:
        prepared = _prepare(seq_len, data, tokenizer, vocab_size, held_out, text_field)
        kept["tokenizer"], prepared.tokenizer = prepared.tokenizer, None  # the rows travel, not the tokenizer
        return prepared

    prepared = on_rank0(on_rank_0, keep_type=True)
    prepared.tokenizer = kept.get("tokenizer")
    return prepared
