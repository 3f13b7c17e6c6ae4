"""Documents to train on: the embedded default corpus, or a user's local files through `datasets`.

The default corpus is CPython's own documentation topics (``pydoc_data/topics.py``, the text
``help("for")`` prints): English prose with code, shipped with every CPython, so the demo has
real text on any machine without a download. It is cut into one document per section.
"""
from __future__ import annotations

import os
import re
from typing import List, Sequence, Tuple

DEFAULT_CORPUS = "pydoc_data.topics"  # the name the job prints
_EXTENSIONS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
# A reST section title: a line, then a line of one repeated punctuation character.
_SECTION = re.compile(r"\n(?=[^\n]+\n([*=\-~^])\1{2,}\n)")


def default_corpus() -> List[str]:
    """CPython's documentation topics, one document per section, in a fixed order."""
    from pydoc_data.topics import topics

    documents = []
    for name in sorted(topics):
        documents += [part.strip() for part in _SECTION.split(topics[name])[::2] if part.strip()]
    return documents


def _data_files(path: str) -> Tuple[str, List[str]]:
    """(datasets builder, files) for a file or a folder of files of one kind."""
    if os.path.isdir(path):
        files = sorted(os.path.join(root, name) for root, _, names in os.walk(path) for name in names
                       if os.path.splitext(name)[1] in _EXTENSIONS)
        if not files:
            raise FileNotFoundError(f"torchpp.data: {path} holds no {', '.join(_EXTENSIONS)} files")
    elif os.path.isfile(path):
        files = [path]
    else:
        raise FileNotFoundError(f"torchpp.data: no file or folder {path}")
    kinds = {_EXTENSIONS.get(os.path.splitext(f)[1]) for f in files}
    if None in kinds:
        raise ValueError(f"torchpp.data: {path}: expected {', '.join(_EXTENSIONS)} files")
    if len(kinds) > 1:
        raise ValueError(f"torchpp.data: {path} mixes file kinds {sorted(kinds)}; give one kind per folder")
    return kinds.pop(), files


def read_documents(path: str, text_field: str = "text") -> List[str]:
    """A user's documents from local files, read through the `datasets` library (no network).

    Args:
        path: a .txt, .jsonl/.json or .parquet file, or a folder of such files (one kind).
            A .txt file gives one document per paragraph (blank-line separated); a .jsonl or
            .parquet file one per record, its `text_field`.
        text_field: the column holding the text in .jsonl and .parquet files.

    Returns:
        The non-empty documents (stripped of surrounding white space), in file order.
    """
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local files only: never ask a hub
    import datasets

    builder, files = _data_files(path)
    datasets.disable_progress_bars()
    options = {"sample_by": "paragraph"} if builder == "text" else {}
    dataset = datasets.load_dataset(builder, data_files=files, split="train", **options)
    field = "text" if builder == "text" else text_field
    if field not in dataset.column_names:
        raise KeyError(f"torchpp.data: {path} has no field {field!r} (fields: {dataset.column_names}); "
                       f"pass text_field= (--text-field)")
    return [text.strip() for text in dataset[field] if text and text.strip()]


def split_documents(documents: Sequence[str], held_out: float) -> Tuple[List[str], List[str]]:
    """(training documents, held-out documents): every round(1 / held_out)-th document is held out.

    Args:
        documents: the corpus, in a fixed order.
        held_out: the fraction held out, in (0, 0.5].
    """
    if not 0 < held_out <= 0.5:
        raise ValueError(f"torchpp.data: held-out fraction {held_out} is not in (0, 0.5]")
    every = round(1 / held_out)
    if len(documents) < every:
        raise ValueError(f"torchpp.data: {len(documents)} documents are too few to hold out {held_out:.0%} of them "
                         f"(one in {every})")
    train = [d for i, d in enumerate(documents) if i % every != every - 1]
    return train, [d for i, d in enumerate(documents) if i % every == every - 1]
