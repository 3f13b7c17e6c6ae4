"""One GPU per rank under NCCL: torchpp's error before NCCL's own.

NCCL refuses two ranks of one communicator on one device ("Duplicate GPU detected"), and says so
only when the first collective runs, deep inside whatever called it. Plain torchrun with more
processes per node than GPUs gets there: ranks map onto the devices by LOCAL_RANK modulo their
count. Before any NCCL call, the ranks of a host post their device's UUID to the rendezvous
store (the UUID, not the index: a launcher may give each rank one GPU through
CUDA_VISIBLE_DEVICES) and every one of them raises the same message, naming the ranks and the
device, when two share one.
"""
from __future__ import annotations

import os
import socket
from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist

__all__ = ["check_one_rank_per_device", "duplicate_device_message"]

_KEY = "torchpp/device/{host}/{local_rank}"


def duplicate_device_message(devices: Dict[int, Tuple[str, str]], host: str) -> Optional[str]:
    """The error for ranks of ``host`` sharing a device, or None when each has its own.

    Args:
        devices: global rank -> (device name as this rank sees it, the device's UUID).
        host: the host's name, for the message.
    """
    by_uuid: Dict[str, list] = {}
    for rank in sorted(devices):
        by_uuid.setdefault(devices[rank][1], []).append(rank)
    shared = [ranks for ranks in by_uuid.values() if len(ranks) > 1]
    if not shared:
        return None
    ranks = shared[0]
    names = ", ".join(f"rank {r} on {devices[r][0]}" for r in ranks)
    return (f"torchpp: {len(devices)} ranks on host {host!r} share {len(by_uuid)} GPU(s) under NCCL, which refuses "
            f"two ranks of one communicator on one device ('Duplicate GPU detected'): {names} are the same GPU "
            f"(UUID {devices[ranks[0]][1]}). Start at most {len(by_uuid)} process(es) per node "
            f"(torchrun --nproc-per-node {len(by_uuid)}), or, to share one GPU in tests, give each rank its own "
            f"NCCL_HOSTID: torchrun --nproc-per-node N -m torchpp.testing.one_gpu SCRIPT (slow: NCCL's sockets)")


def check_one_rank_per_device(store: dist.Store, device: torch.device, rank: int,
                              local_rank: int, local_world_size: int, host: Optional[str] = None) -> None:
    """Raises on every rank of a host when two of its ranks hold one GPU; a no-op when each has its
    own, and where NCCL_HOSTID is set (ranks that declare themselves separate hosts share on purpose).

    Args:
        store: the rendezvous store every rank of the job reaches (keys are per host and local rank).
        device: this rank's CUDA device.
        rank, local_rank, local_world_size: this rank's global rank, its rank on the host and the
            host's rank count (torchrun's RANK, LOCAL_RANK, LOCAL_WORLD_SIZE).
        host: the host's name (default: socket.gethostname()).
    """
    if local_world_size <= 1 or os.environ.get("NCCL_HOSTID"):
        return
    host = host or socket.gethostname()
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    store.set(_KEY.format(host=host, local_rank=local_rank), f"{rank}|{device}|{uuid}")
    devices = {}
    for other in range(local_world_size):  # blocks until each local rank has posted (the store's timeout)
        posted_rank, name, posted_uuid = store.get(_KEY.format(host=host, local_rank=other)).decode().split("|")
        devices[int(posted_rank)] = (name, posted_uuid)
    message = duplicate_device_message(devices, host)
    if message:
        raise RuntimeError(message)
