import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import RankPools  # noqa: E402


@pytest.fixture(scope="session")
def ranks():
    """ranks(world_size) -> a pool of spawned gloo ranks; ranks(n).run(fn, *args) runs fn on every rank."""
    pools = RankPools()
    yield pools
    pools.close()
