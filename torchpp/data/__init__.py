"""Text for language-model training: documents, a tokenizer, packed rows and a resumable loader.

    documents = default_corpus()                       # or read_documents("my_data/")
    tokenizer = default_tokenizer(documents)           # byte-level BPE, trained once and cached
    train, held_out = split_documents(documents, 0.05)
    rows = pack_documents(tokenize(tokenizer, train), seq_len=128, eos_id=tokenizer.eos_token_id)
    loader = PackedLoader(rows, batch_size=16, seed=0, dp_rank=state.dp_rank, dp_size=state.dp)
    batch = next(loader)                               # this replica's rows: input_ids, position_ids
    loader.state_dict()                                # {"epoch", "batch", ...}: part of a checkpoint

See docs/training.md.
"""
from torchpp.data.corpus import DEFAULT_CORPUS, default_corpus, read_documents, split_documents
from torchpp.data.loader import Batch, PackedLoader
from torchpp.data.prepare import TextData, prepare_text
from torchpp.data.packing import PackedRows, pack_documents
from torchpp.data.tokenizer import default_tokenizer, load_tokenizer, tokenize, tokenizer_cache_dir

__all__ = ["Batch", "DEFAULT_CORPUS", "PackedLoader", "PackedRows", "TextData", "prepare_text", "default_corpus", "default_tokenizer",
           "load_tokenizer", "pack_documents", "read_documents", "split_documents", "tokenize",
           "tokenizer_cache_dir"]
