"""Object all-gather and broadcast (pickled) that a process may exit or raise right after.

``torch.distributed.all_gather_object`` and ``broadcast_object_list`` make their byte buffers in
Python. gloo's worker thread can drop a finished collective's last reference after the caller
has moved on, and dropping a tensor Python has seen takes the GIL: when the process is exiting
by then (an error raised on every rank after an agreement, the last line of a script), the
worker cannot have it and the process aborts with "terminate called without an active
exception" (pytorch/pytorch#190489) instead of exiting with the error. torchpp's own object
collectives run here: the bytes travel in buffers made in C++ (csrc/ops/byte_collectives.h),
which nothing in Python ever references.
"""
import pickle
from typing import Any, List, Optional

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _get_object_coll_device

from torchpp import _C
from torchpp.ops import group_name_of

__all__ = ["all_gather_objects", "broadcast_object"]


def _device(group: Optional[dist.ProcessGroup]) -> torch.device:
    """Where the group's object collectives run: the CPU when it has a CPU backend, else the
    current accelerator (as torch.distributed's object collectives choose)."""
    kind = _get_object_coll_device(group)
    return torch.device("cpu") if kind == "cpu" else torch.device(kind, torch.accelerator.current_device_index())


def all_gather_objects(obj: Any, group: Optional[dist.ProcessGroup] = None) -> List[Any]:
    """Every rank's ``obj`` (picklable), in the group's rank order; collective over ``group``
    (None: the default group)."""
    gathered = _C.all_gather_bytes(group_name_of(group), pickle.dumps(obj), _device(group))
    return [pickle.loads(data) for data in gathered]


def broadcast_object(obj: Any, src: int = 0, group: Optional[dist.ProcessGroup] = None) -> Any:
    """Global rank ``src``'s ``obj`` on every rank of ``group`` (``obj`` is ignored elsewhere)."""
    group_src = dist.get_group_rank(group, src) if group is not None else src
    data = pickle.dumps(obj) if dist.get_rank() == src else b""
    return pickle.loads(_C.broadcast_bytes(group_name_of(group), group_src, data, _device(group)))
