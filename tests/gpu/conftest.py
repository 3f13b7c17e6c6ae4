"""tests/gpu: torchpp on CUDA tensors and NCCL, several ranks sharing the one GPU
(torchpp.testing.one_gpu). Without a CUDA device every test here is skipped, with the reason.

TORCHPP_GPU_TESTS_ON_CPU=1 runs them on CPU tensors over gloo instead: the same test code and
launcher path, so a session without a GPU can check them before a GPU session runs them."""
import os

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))

from harness import RankPools  # noqa: E402

ON_CPU = os.environ.get("TORCHPP_GPU_TESTS_ON_CPU") == "1"
HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA or ON_CPU:
        return
    skip = pytest.mark.skip(reason="no CUDA device (torch.cuda.is_available() is False); "
                                   "TORCHPP_GPU_TESTS_ON_CPU=1 runs these on CPU over gloo")
    for item in items:
        if str(item.fspath).startswith(HERE):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def device() -> torch.device:
    """Where the tests' tensors live: the GPU, or the CPU in the dry run."""
    return torch.device("cuda", 0) if HAS_CUDA and not ON_CPU else torch.device("cpu")


@pytest.fixture(scope="session")
def gpu_ranks():
    """gpu_ranks(world_size): spawned ranks over NCCL sharing GPU 0 (gloo on CPU in the dry run)."""
    pools = RankPools(backend="gloo" if ON_CPU or not HAS_CUDA else "nccl")
    yield pools
    pools.close()
