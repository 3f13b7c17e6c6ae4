"""The launcher: 2 and 4 ranks on the one GPU, each with its own NCCL_HOSTID (NCCL then joins
them over its socket transport on loopback). Collectives and point-to-point over NCCL give the
values a sum over ranks must give; the ranks really are distinct NCCL hosts."""
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from torchpp.testing.one_gpu import nccl_environment

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def check_collectives():
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", 0) if dist.get_backend() != "gloo" else torch.device("cpu")
    x = torch.full((1000,), float(rank + 1), device=device)
    dist.all_reduce(x)
    assert torch.equal(x, torch.full_like(x, world * (world + 1) / 2)), f"all-reduce gave {x[:4].tolist()}"
    gathered = torch.empty(world * 3, device=device)
    dist.all_gather_into_tensor(gathered, torch.arange(3, device=device, dtype=torch.float32) + 10 * rank)
    assert torch.equal(gathered.view(world, 3)[:, 0].cpu(), 10 * torch.arange(world, dtype=torch.float32))
    # A ring of sends: each rank receives its left neighbour's rank.
    received = torch.empty(4, device=device)
    ops = [dist.P2POp(dist.isend, torch.full((4,), float(rank), device=device), (rank + 1) % world),
           dist.P2POp(dist.irecv, received, (rank - 1) % world)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    assert torch.equal(received.cpu(), torch.full((4,), float((rank - 1) % world)))
    hosts = [None] * world
    dist.all_gather_object(hosts, nccl_environment(rank)["NCCL_HOSTID"])
    assert len(set(hosts)) == world, f"ranks share a host id: {hosts}"
    return device.type


@pytest.mark.parametrize("world_size", [2, 4])
def test_ranks_share_one_gpu_over_nccl(gpu_ranks, device, world_size):
    assert gpu_ranks(world_size).run(check_collectives, timeout=180) == [device.type] * world_size



def test_plain_torchrun_with_two_ranks_on_one_gpu_names_them(device, tmp_path):
    """Without the launcher, two ranks on the one GPU: torchpp's message on both, not NCCL's
    'Duplicate GPU detected' from inside a first collective."""
    if device.type != "cuda":
        pytest.skip("needs the one GPU: the check reads CUDA device UUIDs")
    script = tmp_path / "layout.py"
    script.write_text("import torchpp.parallel\ntorchpp.parallel.init_parallel(pp=2)\n")
    env = {name: value for name, value in os.environ.items() if name != "NCCL_HOSTID"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script)], cwd=ROOT, env=dict(env, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0, "two ranks on one GPU were accepted"
    named = "rank 0 on cuda:0, rank 1 on cuda:0 are the same GPU"
    assert named in done.stderr and "Duplicate GPU" not in done.stderr, done.stderr[-4000:]
