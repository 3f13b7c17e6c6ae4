"""Scatter/gather P2P ops: each TP rank's slice is 1/t of the message and the all-gather
rebuilds it exactly; sizes that do not divide fall back to the whole tensor."""
import pytest
import torch
import torch.distributed as dist


def _round_trip(shape):
    rank, world = dist.get_rank(), dist.get_world_size()
    full = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    piece = torch.ops.torchpp.pp_scatter_slice(full, rank, world)
    rebuilt = torch.ops.torchpp.pp_gather_slices(piece, list(shape), dist.group.WORLD.group_name, world)
    return piece.numel(), torch.equal(rebuilt, full)


@pytest.mark.parametrize("shape,sliced", [((4, 6, 8), True), ((3, 5, 7), False)])
def test_scatter_gather_round_trip(ranks, shape, sliced):
    results = ranks(2).run(_round_trip, shape, timeout=60)
    numel = torch.Size(shape).numel()
    for sent, equal in results:
        assert equal
        assert sent == (numel // 2 if sliced else numel)


def _opcheck(shape):
    group = dist.group.WORLD
    full = torch.randn(shape, dtype=torch.float64)
    torch.library.opcheck(torch.ops.torchpp.pp_scatter_slice.default, (full, group.rank(), group.size()))
    piece = torch.ops.torchpp.pp_scatter_slice(full, group.rank(), group.size())
    torch.library.opcheck(torch.ops.torchpp.pp_gather_slices.default,
                          (piece, list(shape), group.group_name, group.size()))
    return True


@pytest.mark.parametrize("shape", [(4, 6, 8), (3, 5, 7)])
def test_opcheck(ranks, shape):
    """torch.library.opcheck, dynamic shapes included (the scatter's fake kernel once read a concrete
    numel, which symbolic sizes have not; the gather's once ran its all-gather on fake tensors)."""
    assert ranks(2).run(_opcheck, shape, timeout=120) == [True, True]
