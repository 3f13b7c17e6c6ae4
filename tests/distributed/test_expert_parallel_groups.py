"""init_parallel's expert parallelism: ep groups of consecutive dp x cp ranks (Megatron's layout),
the expert-data-parallel groups that reduce expert gradients, and errors naming the values."""
import pytest
import torch.distributed as dist

from torchpp.parallel import init_parallel
from torchpp.parallel.groups import expert_groups_ranks, mesh_grid


def ranks_of(group):
    return dist.get_process_group_ranks(group)


def check_ep_groups():
    rank = dist.get_rank()
    # 4 ranks, dp=4: ep=2 cuts them in two pairs of consecutive ranks, each splitting the experts.
    state = init_parallel(ep=2)
    assert (state.ep, state.dp, state.ep_rank) == (2, 4, rank % 2)
    assert ranks_of(state.ep_group) == [rank - rank % 2, rank - rank % 2 + 1]
    # The ranks holding the same experts: one per ep group, dp*cp/ep = 2 of them.
    assert ranks_of(state.expert_dp_group) == [rank % 2, rank % 2 + 2]
    assert state.groups()["ep"] is state.ep_group and state.groups()["expert_dp"] is state.expert_dp_group
    # ep inside dp x cp: cp=2 x dp=2 ranks (dp-major) form one ep=4 group; each holds its own experts.
    with_cp = init_parallel(cp=2, ep=4)
    assert ranks_of(with_cp.ep_group) == [0, 1, 2, 3] and with_cp.ep_rank == rank
    assert ranks_of(with_cp.expert_dp_group) == [rank]
    # With tp=2, each tp coordinate's dp ranks split the experts: ranks {0, 2} and {1, 3}.
    with_tp = init_parallel(tp=2, ep=2)
    assert ranks_of(with_tp.ep_group) == [rank % 2, rank % 2 + 2] and with_tp.ep_rank == rank // 2
    # ep = 1: no expert group; expert gradients reduce as every other replicated gradient.
    plain = init_parallel(tp=2)
    assert plain.ep == 1 and plain.ep_group is None and plain.expert_dp_group is plain.dp_cp_group
    for kwargs, message in (
        (dict(tp=2, ep=4), r"ep=4 must divide dp\*cp = 2\*1 = 2"),
        (dict(cp=2, ep=3), r"ep=3 must divide dp\*cp = 2\*2 = 4"),
        (dict(ep=0), "ep=0 must be at least 1"),
    ):
        with pytest.raises(ValueError, match=message):
            init_parallel(**kwargs)
    return True


def test_ep_groups(ranks):
    assert ranks(4).run(check_ep_groups) == [True] * 4


def test_expert_groups_ranks_layout():
    # pp=2 x dp=2 x tp=1 (4 ranks: dp fastest after tp): ep=2 pairs each stage's dp ranks.
    grid = mesh_grid(tp=1, pp=2, dp=2)
    assert expert_groups_ranks(grid, 2) == [([[0, 1]], [[0], [1]]), ([[2, 3]], [[2], [3]])]
