"""Checkpoint directories that are committed atomically.

A save writes `root/step_N.tmp/`; only once every rank has finished does rank 0 rename it to
`root/step_N/` and replace `root/latest` (a file naming the directory) with os.replace. A
save that dies at any point before that leaves `latest` naming the previous, complete
checkpoint; a stale `.tmp` directory is deleted by the next save of that step. A committed
step is never overwritten.
"""
from __future__ import annotations

import os
import shutil
from typing import Any, Callable, Optional

import torch.distributed as dist

LATEST = "latest"
TMP_SUFFIX = ".tmp"


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step_{step}")


def latest_checkpoint(root: str) -> Optional[str]:
    """The directory `root/latest` names, or None when nothing was committed yet.

    Args:
        root: the directory holding step_N checkpoints.
    """
    try:
        with open(os.path.join(root, LATEST)) as f:
            name = f.read().strip()
    except FileNotFoundError:
        return None
    return os.path.join(root, name)


def prepare(root: str, step: int) -> str:
    """Creates an empty `step_N.tmp` (removing a crashed save's leftovers); returns its path."""
    return prepare_directory(step_dir(root, step), "save each step once")


def prepare_directory(final: str, hint: str = "choose a new directory") -> str:
    """Creates an empty `final.tmp` to write into (removing a crashed save's leftovers);
    `final` itself must not exist: replacing it could not be atomic."""
    if os.path.exists(final):
        raise FileExistsError(f"torchpp.checkpoint: {final} already exists; {hint}")
    tmp = final + TMP_SUFFIX
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    os.makedirs(tmp)
    return tmp


def commit_directory(final: str) -> str:
    """Renames the complete `final.tmp` to `final`, durably; returns `final`."""
    os.rename(final + TMP_SUFFIX, final)
    _fsync_dir(os.path.dirname(os.path.abspath(final)))
    return final


def on_rank0(fn: Callable[[], Any]) -> Any:
    """Runs fn on global rank 0 and returns its result on every rank; its error raises everywhere."""
    box = [None, None]
    if dist.get_rank() == 0:
        try:
            box[0] = fn()
        except Exception as error:  # noqa: BLE001 (re-raised on every rank below)
            box[1] = f"{type(error).__name__}: {error}"
    dist.broadcast_object_list(box, src=0)
    if box[1] is not None:
        raise RuntimeError(f"torchpp.checkpoint: rank 0 failed: {box[1]}")
    return box[0]


def commit(root: str, step: int) -> str:
    """Renames `step_N.tmp` to `step_N` and points `latest` at it; returns the final path."""
    final = commit_directory(step_dir(root, step))
    pointer = os.path.join(root, LATEST + TMP_SUFFIX)
    with open(pointer, "w") as f:
        f.write(os.path.basename(final) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(pointer, os.path.join(root, LATEST))
    _fsync_dir(root)
    return final


def _fsync_dir(path: str) -> None:
    # Makes the renames durable across a power loss, not only a process crash.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
