"""torchpp.data in one process: the default corpus, packing with position ids that restart at
each document, the held-out split, local files through `datasets`, the cached tokenizer and
the resumable loader."""
import json

import pytest
import torch

from torchpp.data import (PackedLoader, default_corpus, default_tokenizer, pack_documents, read_documents,
                          split_documents, tokenize)


def test_default_corpus_is_cpythons_documentation_in_sections():
    documents = default_corpus()
    assert len(documents) > 150 and sum(map(len, documents)) > 400_000
    assert any(d.startswith('The "for" statement') for d in documents)
    assert documents == default_corpus()  # a fixed order: the held-out split is the same on every machine


def test_packing_restarts_positions_at_documents_and_rows():
    docs = [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10, 11]]  # + EOS (0) each: 4 + 3 + 7 = 14 tokens
    rows = pack_documents(docs, seq_len=5, eos_id=0)
    assert rows.input_ids.tolist() == [[1, 2, 3, 0, 4], [5, 0, 6, 7, 8]]  # the last 4 tokens fill no row
    assert rows.position_ids.tolist() == [[0, 1, 2, 3, 0], [0, 1, 0, 1, 2]]  # row 2 starts inside document 2


def test_split_holds_out_every_kth_document_and_rejects_bad_fractions():
    train, held = split_documents([str(i) for i in range(40)], 0.05)
    assert held == ["19", "39"] and len(train) == 38
    with pytest.raises(ValueError, match="0.7 is not in"):
        split_documents(["a"] * 40, 0.7)
    with pytest.raises(ValueError, match="3 documents are too few"):
        split_documents(["a"] * 3, 0.05)


def test_loader_resumes_the_same_batches_under_any_data_parallel_size():
    g = torch.Generator().manual_seed(0)
    rows = pack_documents([torch.randint(1, 50, (int(n),), generator=g).tolist() for n in torch.randint(5, 40, (30,))],
                          seq_len=8, eos_id=0)
    straight = PackedLoader(rows, batch_size=4, seed=3)
    seen = [next(straight).input_ids for _ in range(3 * straight.batches_per_epoch)]  # three epochs
    assert not torch.equal(seen[0], seen[straight.batches_per_epoch])  # each epoch its own order
    first = PackedLoader(rows, batch_size=4, seed=3)
    for _ in range(5):
        next(first)
    state = first.state_dict()
    for dp in (1, 2, 4):  # a checkpoint taken at dp=1 resumes at dp=1, 2, 4: each replica its rows
        replicas = [PackedLoader(rows, batch_size=4, seed=3, dp_rank=r, dp_size=dp) for r in range(dp)]
        for loader in replicas:
            loader.load_state_dict(state)
        for k in range(5, len(seen)):
            assert torch.equal(torch.cat([next(loader).input_ids for loader in replicas]), seen[k]), (dp, k)
    with pytest.raises(ValueError, match="seed=3, this one has seed=4"):
        PackedLoader(rows, batch_size=4, seed=4).load_state_dict(state)
    with pytest.raises(ValueError, match="do not fill one batch"):
        PackedLoader(rows, batch_size=len(rows) + 1)


def test_read_documents_from_txt_jsonl_parquet_and_folders(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "txt").mkdir()
    (tmp_path / "txt" / "a.txt").write_text("first paragraph\nstill first\n\nsecond paragraph\n")
    (tmp_path / "txt" / "b.txt").write_text("third\n")
    assert read_documents(str(tmp_path / "txt")) == ["first paragraph\nstill first", "second paragraph", "third"]
    rows = [{"body": "one"}, {"body": ""}, {"body": "two"}]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert read_documents(str(tmp_path / "data.jsonl"), text_field="body") == ["one", "two"]
    pq.write_table(pa.table({"text": ["alpha", "beta"]}), str(tmp_path / "data.parquet"))
    assert read_documents(str(tmp_path / "data.parquet")) == ["alpha", "beta"]
    with pytest.raises(KeyError, match="no field 'text'"):
        read_documents(str(tmp_path / "data.jsonl"))
    with pytest.raises(FileNotFoundError, match="no file or folder"):
        read_documents(str(tmp_path / "nowhere"))
    (tmp_path / "mixed").mkdir()
    (tmp_path / "mixed" / "a.txt").write_text("x")
    pq.write_table(pa.table({"text": ["y"]}), str(tmp_path / "mixed" / "b.parquet"))
    with pytest.raises(ValueError, match="mixes file kinds"):
        read_documents(str(tmp_path / "mixed"))


def test_tokenizer_is_trained_once_then_read_from_the_cache(tmp_path):
    documents = default_corpus()[:40]
    tokenizer, folder, trained = default_tokenizer(documents, vocab_size=600, cache=str(tmp_path))
    again, folder_again, trained_again = default_tokenizer(documents, vocab_size=600, cache=str(tmp_path))
    assert trained and not trained_again and folder == folder_again and len(tokenizer) == 600
    ids = tokenize(again, documents[:3])
    assert ids == tokenize(tokenizer, documents[:3])
    assert again.decode(ids[0]) == documents[0]  # byte-level: every text round-trips
    assert tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids[0]
    other, other_folder, _ = default_tokenizer(documents[:39], vocab_size=600, cache=str(tmp_path))
    assert other_folder != folder  # another corpus, another cache entry
