"""torchpp.testing.one_gpu's environment (what tests/gpu's NCCL ranks and the GPU benchmarks set
per rank), checked without a GPU: its own NCCL host id per rank, loopback sockets unless the
caller chose an interface."""
from torchpp.testing.one_gpu import nccl_environment


def test_each_rank_gets_its_own_host_id(monkeypatch):
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    monkeypatch.setenv("NCCL_HOSTID", "inherited-from-the-launcher")
    envs = [nccl_environment(rank) for rank in range(4)]
    assert len({env["NCCL_HOSTID"] for env in envs}) == 4
    assert all(env["NCCL_SOCKET_IFNAME"] == "lo" and env["NCCL_IB_DISABLE"] == "1" for env in envs)


def test_a_callers_interface_is_kept(monkeypatch):
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "eth1")
    assert nccl_environment(0)["NCCL_SOCKET_IFNAME"] == "eth1"


def test_harness_names_an_unknown_backend():
    import pytest

    from harness import RankPool

    with pytest.raises(ValueError, match="backend must be one of .* got 'mpi'"):
        RankPool(2, backend="mpi")
