"""TP layouts (torchpp.tensor_parallel.layouts): each rank's shard cut from the full tensor, and
the full tensor rebuilt from every rank's shard, exactly; a fused q/k/v projection's shards hold
each rank's query heads and the key/value heads they read (copies where the ranks outnumber
them), fused blocks in groups (Mamba 2's B and C) hold each rank's group, copied likewise, and the
gradient norm counts a copied row on one rank only."""
import pytest
import torch

from torchpp.parallel.clip import local_squared_norm
from torchpp.tensor_parallel.layouts import FusedQKV, HeadCopies, Packed, Split


def _round_trip(layout, full, size):
    shards = [layout.shard(full, rank, size) for rank in range(size)]
    assert torch.equal(layout(shards), full)
    assert layout.full_shape(shards[0].shape, size) == full.shape
    return shards


@pytest.mark.parametrize("layout, rows", [(Split(0, 12), 12), (Split(0, 9, pad=True), 9),
                                          (Packed(0, [4, 8]), 12), (HeadCopies(0, 3, 2), 6),
                                          (Packed(0, [8, 2, 2, 4], [0, 1, 1, 0]), 16),
                                          (Packed(0, [8, 4, 4, 4], [0, 2, 2, 0]), 20)])
def test_layouts_round_trip(layout, rows):
    _round_trip(layout, torch.randn(rows, 5, dtype=torch.float64), 4 if isinstance(layout, HeadCopies) else 2)


# (query heads, key/value heads, ranks): one key/value head (multi-query), fewer than the ranks, as
# many as the ranks, more than the ranks, and multi-head.
SHAPES = [(4, 1, 2), (8, 2, 4), (4, 2, 2), (8, 4, 2), (4, 4, 2), (8, 2, 8)]


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("heads, kv, size", SHAPES)
def test_fused_qkv_round_trip(heads, kv, size, grouped):
    head_dim = 3
    full = torch.randn((heads + 2 * kv) * head_dim, 5, dtype=torch.float64)
    for dim, tensor in ((0, full), (1, full.t().contiguous())):  # nn.Linear's [out, in], Conv1D's [in, out]
        shards = _round_trip(FusedQKV(dim, head_dim, heads, kv, grouped), tensor, size)
        assert all(s.shape[dim] == (heads // size + 2 * max(1, kv // size)) * head_dim for s in shards)


def _heads(layout, size):
    """Each rank's shard as head labels: q0.., k0.., v0.. (one row per head)."""
    heads, kv = layout.num_heads, layout.num_kv_heads
    if layout.grouped:
        labels = [x for g in range(kv) for x in [f"q{g * heads // kv + i}" for i in range(heads // kv)] + [f"k{g}", f"v{g}"]]
    else:
        labels = [f"q{h}" for h in range(heads)] + [f"k{j}" for j in range(kv)] + [f"v{j}" for j in range(kv)]
    full = torch.arange(len(labels), dtype=torch.float64)
    return [[labels[int(i)] for i in layout.shard(full, rank, size)] for rank in range(size)]


def test_fused_qkv_shards_hold_query_heads_and_the_key_value_heads_they_read():
    assert _heads(FusedQKV(0, 1, 4, 1), 2) == [["q0", "q1", "k0", "v0"], ["q2", "q3", "k0", "v0"]]
    assert _heads(FusedQKV(0, 1, 8, 2), 4) == [["q0", "q1", "k0", "v0"], ["q2", "q3", "k0", "v0"],
                                               ["q4", "q5", "k1", "v1"], ["q6", "q7", "k1", "v1"]]
    assert _heads(FusedQKV(0, 1, 4, 2), 2) == [["q0", "q1", "k0", "v0"], ["q2", "q3", "k1", "v1"]]
    assert _heads(FusedQKV(0, 1, 8, 4), 2) == [["q0", "q1", "q2", "q3", "k0", "k1", "v0", "v1"],
                                               ["q4", "q5", "q6", "q7", "k2", "k3", "v2", "v3"]]
    grouped = FusedQKV(0, 1, 8, 4, grouped=True)
    assert _heads(grouped, 2) == [["q0", "q1", "k0", "v0", "q2", "q3", "k1", "v1"],
                                  ["q4", "q5", "k2", "v2", "q6", "q7", "k3", "v3"]]
    assert _heads(FusedQKV(0, 1, 8, 2, grouped=True), 4)[1] == ["q2", "q3", "k0", "v0"]


def test_fused_qkv_copies_are_uncounted_but_on_their_first_rank():
    layout = FusedQKV(0, 3, 8, 2)
    assert layout.copied_features(4) == 6 and layout.copied_features(2) == 0
    assert [layout.uncounted(rank, 4) for rank in range(4)] == [range(0), range(6, 12), range(0), range(6, 12)]


def test_fused_qkv_refuses_sizes_that_do_not_split():
    with pytest.raises(ValueError, match="num_heads=4 with num_kv_heads=1"):
        FusedQKV(0, 3, 4, 1).shard(torch.zeros(18, 2), 0, 3)
    with pytest.raises(ValueError, match="size 17 along dim 0 where 18"):
        FusedQKV(0, 3, 4, 1).shard(torch.zeros(17, 2), 0, 2)


def test_norm_counts_copied_rows_once_also_in_a_zero_segment():
    param = torch.nn.Parameter(torch.zeros(6, 4))
    param.tensor_model_parallel, param.tp_uncounted = True, (0, 4, 6)  # rows 4, 5: copies another rank counts
    grad = torch.arange(24, dtype=torch.float64).view(6, 4)
    assert local_squared_norm([(grad, param)], tp_rank=1).item() == grad[:4].pow(2).sum().item()
    param.zero_param_lo = 10  # a ZeRO segment: flat elements 10..19 of the parameter
    segment = grad.flatten()[10:20]
    assert local_squared_norm([(segment, param)], tp_rank=1).item() == grad.flatten()[10:16].pow(2).sum().item()


def test_packed_groups_give_each_rank_its_group_copied_where_ranks_outnumber_them():
    # [x: 8 | B: 2 groups of 2 | C: 2 groups of 2 | dt: 4] over 4 ranks: ranks 0, 1 hold group 0 of B and C
    full = torch.arange(20)
    layout = Packed(0, [8, 4, 4, 4], [0, 2, 2, 0])
    shards = [layout.shard(full, rank, 4).tolist() for rank in range(4)]
    assert shards[0] == [0, 1, 8, 9, 12, 13, 16] and shards[1] == [2, 3, 8, 9, 12, 13, 17]
    assert shards[3] == [6, 7, 10, 11, 14, 15, 19]
    assert layout.copied_rows(4) == (2, 6, 2) and layout.copied_rows(2) is None  # over 2 ranks: plain split
    assert [layout.uncounted(rank, 4) for rank in range(4)] == [range(0), range(2, 6), range(0), range(2, 6)]
    with pytest.raises(ValueError, match="a fused block of 4 in 2 groups does not split over the tensor-parallel size 3"):
        Packed(0, [6, 4], [0, 2]).shard(torch.zeros(10), 0, 3)
