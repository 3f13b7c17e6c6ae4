"""Ranks of one host on one GPU under NCCL: every rank gets torchpp's message, naming the ranks
and the device, before NCCL's "Duplicate GPU detected" would surface inside a first collective.

The ranks are threads posting to one in-memory store, each reporting a device UUID through a
stand-in for torch.cuda.get_device_properties (no GPU here); tests/gpu runs the real thing."""
import threading
from types import SimpleNamespace

import torch
import torch.distributed as dist

from torchpp.parallel.device_check import check_one_rank_per_device, duplicate_device_message


def run_host(monkeypatch, uuids, host="node7"):
    """Each local rank i (global rank 10 + i) holds cuda:0 with uuids[i]; returns each rank's error."""
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(uuid=uuids[int(threading.current_thread().name)]))
    monkeypatch.delenv("NCCL_HOSTID", raising=False)
    store, errors = dist.HashStore(), [None] * len(uuids)

    def rank(i):
        try:
            check_one_rank_per_device(store, torch.device("cuda", 0), 10 + i, i, len(uuids), host=host)
        except RuntimeError as error:
            errors[i] = str(error)

    threads = [threading.Thread(target=rank, args=(i,), name=str(i)) for i in range(len(uuids))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not any(thread.is_alive() for thread in threads), "a rank waited for the others forever"
    return errors


def test_every_rank_names_the_ranks_sharing_a_gpu(monkeypatch):
    errors = run_host(monkeypatch, ["GPU-a", "GPU-b", "GPU-a", "GPU-b"])
    assert all(errors), errors
    assert len(set(errors)) == 1, "ranks disagree on the message"
    assert "rank 10 on cuda:0, rank 12 on cuda:0 are the same GPU (UUID GPU-a)" in errors[0]
    assert "4 ranks on host 'node7' share 2 GPU(s)" in errors[0]
    assert "--nproc-per-node 2" in errors[0] and "torchpp.testing.one_gpu" in errors[0]


def test_one_gpu_per_rank_passes_whatever_the_device_index(monkeypatch):
    # CUDA_VISIBLE_DEVICES may give each rank one GPU: every rank sees cuda:0, all distinct devices.
    assert run_host(monkeypatch, ["GPU-a", "GPU-b", "GPU-c"]) == [None] * 3


def test_ranks_with_their_own_nccl_host_id_share_on_purpose(monkeypatch):
    monkeypatch.setenv("NCCL_HOSTID", "rank-0")
    check_one_rank_per_device(dist.HashStore(), torch.device("cuda", 0), 0, 0, 2)  # would wait for rank 1


def test_the_message_alone():
    assert duplicate_device_message({0: ("cuda:0", "u0"), 1: ("cuda:1", "u1")}, "h") is None
    message = duplicate_device_message({3: ("cuda:1", "u1"), 1: ("cuda:1", "u1")}, "h")
    assert "rank 1 on cuda:1, rank 3 on cuda:1 are the same GPU" in message
    assert duplicate_device_message({0: ("cuda:0", "u")}, "h") is None
