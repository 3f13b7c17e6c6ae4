"""Tokenizers: a byte-level BPE trained on the corpus at first use and cached, or a local one.

Both come back as a transformers ``PreTrainedTokenizerFast``, so ``save_pretrained`` writes
one that ``AutoTokenizer.from_pretrained`` reads next to a saved model.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from typing import List, Optional, Sequence

EOS = "<|endoftext|>"  # ends every document; also the padding token


def tokenizer_cache_dir() -> str:
    """Where trained tokenizers are kept: $TORCHPP_CACHE, else $XDG_CACHE_HOME/torchpp, else
    ~/.cache/torchpp; one folder per corpus and vocabulary size under ``tokenizers/``."""
    root = os.environ.get("TORCHPP_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "torchpp")
    return os.path.join(root, "tokenizers")


def _fingerprint(documents: Sequence[str], vocab_size: int) -> str:
    digest = hashlib.sha256(f"byte-level-bpe v1 {vocab_size} {len(documents)}".encode())
    for document in documents:
        digest.update(document.encode())
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def train_bpe(documents: Sequence[str], vocab_size: int):
    """A byte-level BPE of `vocab_size` tokens (EOS included) trained on `documents`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(documents, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS, pad_token=EOS)


def default_tokenizer(documents: Sequence[str], vocab_size: int = 4096, cache: Optional[str] = None):
    """The byte-level BPE of `documents`: read from the cache, or trained now and cached.

    Args:
        documents: the corpus it is trained on (its content names the cache entry).
        vocab_size: tokens in the vocabulary, EOS included.
        cache: the cache folder (default: tokenizer_cache_dir()).

    Returns:
        (tokenizer, its folder, whether it was trained now).
    """
    from transformers import AutoTokenizer

    folder = os.path.join(cache or tokenizer_cache_dir(), f"bpe{vocab_size}-{_fingerprint(documents, vocab_size)}")
    if os.path.isfile(os.path.join(folder, "tokenizer.json")):
        return AutoTokenizer.from_pretrained(folder), folder, False
    tokenizer = train_bpe(documents, vocab_size)
    os.makedirs(os.path.dirname(folder), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=os.path.basename(folder) + ".", dir=os.path.dirname(folder))
    tokenizer.save_pretrained(tmp)
    try:
        os.rename(tmp, folder)  # atomic: a concurrent first use keeps one of two equal folders
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return tokenizer, folder, True


def load_tokenizer(folder: str):
    """A local transformers tokenizer (a folder ``save_pretrained`` wrote); never downloads."""
    from transformers import AutoTokenizer

    if not os.path.isdir(folder):
        raise FileNotFoundError(f"torchpp.data: no tokenizer folder {folder}")
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    if tokenizer.eos_token_id is None:
        raise ValueError(f"torchpp.data: the tokenizer in {folder} has no EOS token to end documents with")
    return tokenizer


def tokenize(tokenizer, documents: Sequence[str]) -> List[List[int]]:
    """Each document's token ids (no special tokens added; packing appends EOS)."""
    return tokenizer(list(documents), add_special_tokens=False)["input_ids"]
