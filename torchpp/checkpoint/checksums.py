"""Checksums of a checkpoint's files: recorded when a save commits, verified before a load.

Every file of a committed step directory (DCP's data files and its `.metadata` index) has its
size and CRC32C in `checksums.json`, which ends with the CRC32C of its own text, so a flipped
byte in any file, the list included, is caught. Saving: once every rank's files are written,
each rank checksums its share of them (file i goes to rank i % world), and rank 0 writes the
list just before the rename that commits the directory. Loading: each rank verifies its share;
any mismatch raises on every rank before anything is read into the model.
"""
from __future__ import annotations

import json
import os
from typing import Dict, List, Optional

import torch.distributed as dist

from torchpp.checkpoint.directory import IncompleteCheckpointError, on_rank0
from torchpp.parallel.object_collectives import all_gather_objects

MANIFEST = "checksums.json"
ALGORITHM = "crc32c"
_BLOCK = 4 << 20


class CorruptCheckpointError(RuntimeError):
    """A checkpoint file whose content differs from the checksum recorded when it was saved."""


def file_crc32c(path: str) -> str:
    """The CRC32C of a file's bytes, as 8 hex digits."""
    try:
        import crc32c
    except ImportError as error:  # a dependency of scripts/setup_env.sh
        raise ImportError("torchpp.checkpoint: checksums need the crc32c package (pip install crc32c)") from error
    value = 0
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            value = crc32c.crc32c(block, value)
    return f"{value:08x}"


def _text_crc32c(text: str) -> str:
    import crc32c

    return f"{crc32c.crc32c(text.encode()):08x}"


def _share(names: List[str], group) -> List[str]:
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    return names[rank::size]


def record_checksums(path: str, group=None) -> Dict[str, dict]:
    """{file name: {"bytes", "crc32c"}} for every file in `path`, each rank computing its share.
    Collective over `group` (default: the world); call it once every rank's files are written."""
    names = sorted(n for n in os.listdir(path) if n != MANIFEST and os.path.isfile(os.path.join(path, n)))
    mine = {n: {"bytes": os.path.getsize(os.path.join(path, n)), ALGORITHM: file_crc32c(os.path.join(path, n))}
            for n in _share(names, group)}
    return {name: entry for share in all_gather_objects(mine, group) for name, entry in sorted(share.items())}


def write_manifest(path: str, checksums: Dict[str, dict]) -> None:
    """Writes `path`/checksums.json (durably): the list, then a line with its own CRC32C."""
    text = json.dumps({"algorithm": ALGORITHM, "files": checksums}, indent=1, sort_keys=True)
    with open(os.path.join(path, MANIFEST), "w") as f:
        f.write(f"{text}\n{ALGORITHM} {_text_crc32c(text)}\n")
        f.flush()
        os.fsync(f.fileno())


def read_manifest(path: str) -> Optional[Dict[str, dict]]:
    """The recorded checksums of `path`, or None when it has none (saved before they were
    recorded). Raises CorruptCheckpointError when the list itself does not match its CRC32C."""
    file = os.path.join(path, MANIFEST)
    if not os.path.isfile(file):
        return None
    with open(file, "rb") as f:
        raw = f.read()
    text, _, last = raw.decode("utf-8", errors="replace").rstrip("\n").rpartition("\n")
    if last != f"{ALGORITHM} {_text_crc32c(text)}":
        raise CorruptCheckpointError(f"torchpp.checkpoint: {file} does not match its own {ALGORITHM} (the file is "
                                     f"corrupted); nothing was loaded")
    return json.loads(text)["files"]


def _problems(path: str, names: List[str], checksums: Dict[str, dict]) -> List[tuple]:
    found = []
    for name in names:
        file, want = os.path.join(path, name), checksums[name]
        if not os.path.isfile(file):
            found.append(("missing", f"its file {name} is missing"))
        elif os.path.getsize(file) != want["bytes"]:
            found.append(("size", f"its file {name} holds {os.path.getsize(file)} bytes, {want['bytes']} were "
                                  f"saved"))
        elif file_crc32c(file) != want[ALGORITHM]:
            found.append(("corrupt", f"{file} has {ALGORITHM} {file_crc32c(file)}, {want[ALGORITHM]} was recorded "
                                     f"when it was saved (the file is corrupted)"))
    return found


def verify_checksums(path: str, group=None) -> bool:
    """Checks every file of the checkpoint `path` against its recorded checksum, each rank its
    share. Collective over `group` (default: the world). Returns False when `path` records no
    checksums. Raises on every rank, naming every bad file: IncompleteCheckpointError when a
    file is missing or has another size, CorruptCheckpointError when its content differs."""
    checksums = on_rank0(lambda: read_manifest(path), keep_type=True, group=group)
    if checksums is None:
        return False
    found = _problems(path, _share(sorted(checksums), group), checksums)
    found = [problem for share in all_gather_objects(found, group) for problem in share]
    if not found:
        return True
    corrupt = any(k == "corrupt" for k, _ in found)
    details = "; ".join(text for _, text in found)
    what = "is corrupted" if corrupt else "is not a complete checkpoint"
    raise (CorruptCheckpointError if corrupt else IncompleteCheckpointError)(
        f"torchpp.checkpoint: {path} {what}: {details}; nothing was loaded (load another step with step=, or skip "
        f"the check with verify=False)")
