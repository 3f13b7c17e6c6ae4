"""Every generator over p in 1..16, m in 1..64, v in 1..4: valid (plain, lowered and lowered in
order) and deadlock-free in the simulator, the in-order lowering also on a blocking in-order
transport (check_in_order_p2p), or refused with the documented constraint error. The sweep runs
in C++ in one call (torchpp._schedule.sweep)."""
import pytest

from torchpp import _schedule
from torchpp import schedule as S


@pytest.mark.parametrize("name", S.SCHEDULES)
def test_grid(name):
    served, rejected, failures = _schedule.sweep([name], 16, 64, 4)
    assert failures == []
    assert served + rejected == 16 * 64 * 4
    assert served > 0


@pytest.mark.parametrize("name,p,m,v,constraint", [
    ("dualpipe", 3, 12, 2, "even number of ranks"),
    ("dualpipe", 4, 9, 2, "even number of microbatches"),
    ("dualpipe", 4, 6, 2, "m >= 2p"),
    ("dualpipe-v", 4, 7, 2, "m >= 2p"),
    ("zb-v", 4, 8, 3, "num_chunks == 2"),
    ("1f1b", 4, 8, 2, "num_chunks == 1"),
    ("interleaved-1f1b", 4, 10, 2, "microbatch_group_size dividing m"),
])
def test_documented_constraint_errors(name, p, m, v, constraint):
    kwargs = {"microbatch_group_size": 4} if name == "interleaved-1f1b" else {}
    with pytest.raises(ValueError, match=constraint) as info:
        S.generate(name, p, m, num_chunks=v, **kwargs)
    assert f"p={p}" in str(info.value) and f"m={m}" in str(info.value)


def test_unknown_schedule_lists_the_known_ones():
    with pytest.raises(ValueError, match="known: gpipe"):
        S.generate("pipedream-2bw", 4, 8)


@pytest.mark.parametrize("p,m", [(4, 5), (4, 6), (3, 7), (8, 12)])
def test_m_not_divisible_by_p(p, m):
    for name in ["gpipe", "1f1b", "zb-h1", "zb-h2", "zb-auto", "interleaved-1f1b", "looped-bfs", "zb-v"]:
        sch = S.generate(name, p, m)
        sch.validate()
        assert sum(len(sch.actions(r)) for r in range(p)) >= sch.num_stages * m * 2
