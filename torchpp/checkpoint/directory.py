"""Checkpoint directories that are committed atomically, and found again after any crash.

A save writes `root/step_N.tmp/`; only once every rank has finished does rank 0 rename it to
`root/step_N/` and replace `root/latest` (a file naming the directory) with os.replace. A
save that dies before the rename leaves `latest` naming the previous, complete checkpoint; a
stale `.tmp` directory is deleted by the next save of that step. A save that dies between
the rename and the replacement of `latest` leaves a complete `step_N` that `latest` does not
name: the latest checkpoint is then that newer directory (it is adopted); one that is not
complete after all (files lost or truncated) is refused, with the reason, and replaced by
the next save of step N. A committed step (the one `latest` names, or an older one) is never
overwritten.
"""
from __future__ import annotations

import os
import re
import shutil
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch.distributed as dist

from torchpp.parallel.object_collectives import broadcast_object

LATEST = "latest"
TMP_SUFFIX = ".tmp"
METADATA = ".metadata"  # DCP's index of the checkpoint's files, written after all of them
_STEP = re.compile(r"^step_(\d+)$")


class IncompleteCheckpointError(FileNotFoundError):
    """A step directory whose DCP index or files are missing or truncated."""


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step_{step}")


def step_dirs(root: str) -> Dict[int, str]:
    """step -> `root/step_N` for every step directory in `root`, complete or not (no `.tmp`)."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return {}
    found = {}
    for name in names:
        match = _STEP.match(name)
        if match and os.path.isdir(os.path.join(root, name)):
            found[int(match.group(1))] = os.path.join(root, name)
    return found


def incomplete_reason(path: str) -> Optional[str]:
    """Why `path` is not a complete checkpoint (DCP's index missing or unreadable, a file it
    lists missing or shorter than the index says), or None when it is complete."""
    from torch.distributed.checkpoint import FileSystemReader

    if not os.path.isfile(os.path.join(path, METADATA)):
        return f"it has no {METADATA} (DCP's index, written after every rank's files)"
    try:
        metadata = FileSystemReader(path).read_metadata()
    except Exception as error:  # noqa: BLE001 (a truncated pickle raises anything)
        return f"its {METADATA} cannot be read ({type(error).__name__}: {error})"
    needed: Dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            return f"its file {name} is missing"
        if os.path.getsize(file) < size:
            return f"its file {name} holds {os.path.getsize(file)} bytes, the index needs {size}"
    return None


def _named_by_latest(root: str) -> Optional[str]:
    try:
        with open(os.path.join(root, LATEST)) as f:
            return f.read().strip() or None
    except FileNotFoundError:
        return None


def _step_of(name: Optional[str]) -> int:
    match = _STEP.match(name) if name else None
    return int(match.group(1)) if match else -1


def resolve_latest(root: str) -> Tuple[Optional[str], List[str]]:
    """(the latest checkpoint of `root` or None, notes on the newer step directories refused).

    The newest complete step directory newer than the one `latest` names (left by a commit
    that died before replacing `latest`: adopted), else the one `latest` names."""
    name = _named_by_latest(root)
    named_step = _step_of(name)
    notes = []
    for step, path in sorted(step_dirs(root).items(), reverse=True):
        if step <= named_step:
            break
        reason = incomplete_reason(path)
        if reason is None:
            return path, notes
        notes.append(f"{path} is not a complete checkpoint ({reason}), so it is not loaded ("
                     + (f"latest names {name}" if name else "no 'latest' file") + f"); saving step {step} replaces it")
    return (os.path.join(root, name) if name else None), notes


def latest_checkpoint(root: str) -> Optional[str]:
    """The latest complete checkpoint of `root`, or None when there is none.

    That is the directory `root/latest` names, unless a newer complete `step_N` exists, left
    by a save that died between renaming it and replacing `latest`: that one is adopted.

    Args:
        root: the directory holding step_N checkpoints.
    """
    return resolve_latest(root)[0]


def _existing(root: str) -> str:
    steps = sorted(step_dirs(root))
    return (f"step directories: {steps if steps else 'none'}; latest names "
            + (_named_by_latest(root) or "nothing (no 'latest' file)"))


def checkpoint_to_load(root: str, step: Optional[int], check: bool = True) -> str:
    """The directory to load: `step`'s, else the latest (see latest_checkpoint). Raises
    FileNotFoundError naming what exists when there is none; with `check`, also
    IncompleteCheckpointError saying what is missing when it is not complete (see
    check_complete); warns about newer directories it refused."""
    if step is None:
        path, notes = resolve_latest(root)
        for note in notes:
            warnings.warn(f"torchpp.checkpoint: {note}", stacklevel=3)
        if path is None:
            raise FileNotFoundError(f"torchpp.checkpoint: no committed checkpoint in {root} (no 'latest' file; "
                                    f"{_existing(root)})")
        if not os.path.isdir(path):
            raise FileNotFoundError(f"torchpp.checkpoint: {root}/latest names {os.path.basename(path)}, which does "
                                    f"not exist; {_existing(root)}")
    else:
        path = step_dir(root, step)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"torchpp.checkpoint: no checkpoint for step {step} in {root}; {_existing(root)}")
    if check:
        check_complete(path)
    return path


def check_complete(path: str) -> None:
    """Raises IncompleteCheckpointError saying what is missing when `path` is not complete."""
    reason = incomplete_reason(path)
    if reason is not None:
        root = os.path.dirname(path)
        raise IncompleteCheckpointError(f"torchpp.checkpoint: {path} is not a complete checkpoint: {reason}; "
                                        f"{_existing(root)}")


def prepare(root: str, step: int) -> str:
    """Creates an empty `step_N.tmp` (removing a crashed save's leftovers); returns its path.

    An existing `step_N` newer than the step `latest` names was left by a save that died
    before its commit finished: it is replaced (renamed to the `.tmp` name first, so that no
    crash leaves a partial `step_N`). The one `latest` names, or an older one, is never."""
    final = step_dir(root, step)
    if os.path.exists(final):
        name = _named_by_latest(root)
        if _step_of(name) >= step:
            raise FileExistsError(f"torchpp.checkpoint: {final} already exists and is committed (latest names "
                                  f"{name}); save each step once, or into another root")
        warnings.warn(f"torchpp.checkpoint: replacing {final}, left by a save that died before its commit finished "
                      f"(latest names {name or 'nothing'})", stacklevel=2)
        tmp = final + TMP_SUFFIX
        if os.path.exists(tmp):
            shutil.rmtree(tmp)
        os.rename(final, tmp)
        _fsync_dir(root)
    return prepare_directory(final, "save each step once")


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


def on_rank0(fn: Callable[[], Any], keep_type: bool = False, group=None) -> Any:
    """Runs fn on global rank 0 and returns its result on every rank of `group` (default: the
    world, which holds rank 0); its error raises everywhere (as a RuntimeError saying rank 0
    failed, or with keep_type, as an error of its own type)."""
    box = [None, None]
    if dist.get_rank() == 0:
        try:
            box[0] = fn()
        except Exception as error:  # noqa: BLE001 (re-raised on every rank below)
            box[1] = (type(error), str(error))
    box = broadcast_object(box, src=0, group=group)
    if box[1] is not None:
        kind, text = box[1]
        if keep_type:
            try:
                error = kind(text)
            except Exception:  # noqa: BLE001 (a type whose constructor takes other arguments)
                error = RuntimeError(f"torchpp.checkpoint: rank 0 failed: {kind.__name__}: {text}")
            raise error
        raise RuntimeError(f"torchpp.checkpoint: rank 0 failed: {kind.__name__}: {text}")
    return box[0]


def commit(root: str, step: int, checksums: Optional[Dict[str, dict]] = None) -> str:
    """Writes the files' checksums into `step_N.tmp` (when given), renames it to `step_N` and
    points `latest` at it; returns the final path."""
    if checksums is not None:
        from torchpp.checkpoint.checksums import write_manifest

        write_manifest(step_dir(root, step) + TMP_SUFFIX, checksums)
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
