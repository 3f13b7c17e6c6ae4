import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# The rank-side checks of tests/distributed and tests/ops, reused by tests/gpu (with a device) and
# tests/faults (spawned ranks inherit sys.path).
for _folder in ("distributed", "ops"):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), _folder))

from harness import RankPools  # noqa: E402


@pytest.fixture(scope="session")
def ranks():
    """ranks(world_size) -> a pool of spawned gloo ranks; ranks(n).run(fn, *args) runs fn on every rank."""
    pools = RankPools()
    yield pools
    pools.close()
