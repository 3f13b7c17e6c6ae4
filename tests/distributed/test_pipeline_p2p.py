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
