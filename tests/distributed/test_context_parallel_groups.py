"""init_parallel's cp dimension: Megatron's tp-cp-dp-pp order, the cp, dp-cp and model-parallel
groups, orders without cp while cp = 1, and errors naming the values."""
import pytest
import torch.distributed as dist

from torchpp.parallel import init_parallel, mesh_grid, rank_grid


def ranks_of(group):
    return dist.get_process_group_ranks(group)


def check_cp_groups():
    rank = dist.get_rank()
    # 8 ranks: tp=2 fastest, then cp=2, then dp=2.
    state = init_parallel(tp=2, cp=2)
    assert (state.tp, state.cp, state.dp, state.pp) == (2, 2, 2, 1)
    assert state.mesh.mesh_dim_names == ("pp", "dp", "cp", "tp")
    assert (state.tp_rank, state.cp_rank, state.dp_rank) == (rank % 2, rank // 2 % 2, rank // 4)
    assert ranks_of(state.cp_group) == [rank - rank % 4 + rank % 2, rank - rank % 4 + rank % 2 + 2]
    assert ranks_of(state.dp_group) == [rank % 4, rank % 4 + 4]
    # Megatron's dp-cp group: same tp (and pp) coordinate.
    assert ranks_of(state.dp_cp_group) == [r for r in range(8) if r % 2 == rank % 2]
    # Norms sum over pp x tp only: cp ranks hold the same (summed) gradients.
    assert ranks_of(state.model_parallel_group) == [rank - rank % 2, rank - rank % 2 + 1]
    assert state.groups()["cp"] is state.cp_group
    # cp = 1: the dp-cp group is the dp group, and orders without cp still work.
    plain = init_parallel(tp=2, pp=2, order="tp-dp-pp")
    assert plain.cp == 1 and plain.dp_cp_group is plain.dp_group
    assert ranks_of(plain.model_parallel_group) == [r for r in range(8) if r // 2 % 2 == rank // 2 % 2]
    swapped = init_parallel(cp=2, dp=2, tp=2, order="cp-tp-dp-pp")
    assert ranks_of(swapped.cp_group) == [rank - rank % 2, rank - rank % 2 + 1]
    for kwargs, message in (
        (dict(tp=3, cp=2), r"world size 8 is not divisible by tp\*pp\*cp = 3\*1\*2 = 6"),
        (dict(cp=2, dp=2), r"tp\*pp\*cp\*dp = 1\*1\*2\*2 = 4 does not equal the world size 8"),
        (dict(cp=0), "cp=0 must be at least 1"),
        (dict(cp=2, order="tp-dp-pp"), "with cp=2 it must place cp too"),
    ):
        with pytest.raises(ValueError, match=message):
            init_parallel(**kwargs)
    return True


def test_cp_groups(ranks):
    assert ranks(8).run(check_cp_groups) == [True] * 8


def test_mesh_grid_orders():
    grid = mesh_grid(tp=2, pp=2, dp=2, cp=2)  # [pp, dp, cp, tp]
    assert grid[1, 0, 1, 1].item() == 8 + 2 + 1
    assert grid[0, 1, 0, 0].item() == 4
    assert mesh_grid(tp=2, pp=1, dp=2, cp=2, order="cp-tp-dp-pp")[0, 1, 1, 0].item() == 4 + 1
    assert rank_grid(tp=2, pp=2, dp=2).tolist() == rank_grid(tp=2, pp=2, dp=2, order="tp-dp-pp").tolist()
