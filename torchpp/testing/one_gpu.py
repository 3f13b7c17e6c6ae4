"""Several NCCL ranks on one GPU, for tests and benchmarks on a machine with a single device.

NCCL refuses two ranks of a communicator on one device ("Duplicate GPU detected"). It tells
ranks apart by host and device, so a rank given its own ``NCCL_HOSTID`` looks like another
host: NCCL then connects the ranks through its socket transport over the loopback interface.
That is correct (the same collectives, the same results) but slow, so keep tensors small. Works
with NCCL 2.28/2.29.

A script meant for one GPU per rank runs on the one GPU under torchrun through this module::

    torchrun --nproc-per-node 2 -m torchpp.testing.one_gpu examples/train_llama.py --tp 1 --pp 2
"""
from __future__ import annotations

import os
import runpy
import sys
from typing import Dict, List, Optional

import torch

__all__ = ["main", "nccl_environment", "share_one_gpu"]


def nccl_environment(rank: int) -> Dict[str, str]:
    """What a rank's environment needs to share the one GPU under NCCL: its own host id, the
    loopback interface for NCCL's sockets, and no InfiniBand probing (none is there to find).
    Variables the caller set already are kept."""
    wanted = {"NCCL_HOSTID": f"torchpp-rank-{rank}", "NCCL_SOCKET_IFNAME": "lo", "NCCL_IB_DISABLE": "1"}
    return {name: os.environ.get(name, value) if name != "NCCL_HOSTID" else value for name, value in wanted.items()}


def share_one_gpu(rank: int) -> torch.device:
    """Prepares this process (rank ``rank`` of a group on one machine) to use GPU 0 beside the
    other ranks: call before creating the NCCL process group.

    Args:
        rank: this process's rank on the machine (e.g. torchrun's LOCAL_RANK).

    Returns:
        The device every rank uses, ``cuda:0``.
    """
    if not torch.cuda.is_available():
        raise RuntimeError(f"torchpp.testing.share_one_gpu: rank {rank} sees no CUDA device "
                           f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
    os.environ.update(nccl_environment(rank))
    torch.cuda.set_device(0)
    return torch.device("cuda", 0)


def main(argv: Optional[List[str]] = None) -> None:
    """``python -m torchpp.testing.one_gpu SCRIPT [ARGS...]``, each rank under torchrun: shares GPU 0
    (``share_one_gpu`` with torchrun's LOCAL_RANK), then runs SCRIPT as ``python SCRIPT ARGS`` would.
    Without a CUDA device it runs SCRIPT as it is (on the CPU, over gloo)."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        raise SystemExit("usage: torchrun --nproc-per-node N -m torchpp.testing.one_gpu SCRIPT [ARGS...]")
    if torch.cuda.is_available():
        share_one_gpu(int(os.environ.get("LOCAL_RANK", "0")))
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))  # as `python SCRIPT` sets it
    runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
