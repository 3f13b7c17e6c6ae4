"""torchpp.parallel.object_collectives: torchpp's object all-gather and broadcast, whose bytes
travel in buffers made in C++ (no Python object on them, so gloo's worker never needs the GIL to
free them while a raising process exits: pytorch/pytorch#190489). On real gloo ranks: every
rank's object in group-rank order, lengths that differ by rank, subgroups, a source that is not
group rank 0. (tests/faults/test_nonfinite.py guards that torchpp uses no torch.distributed object
collective.)"""
import torch
import torch.distributed as dist

from torchpp.parallel.object_collectives import all_gather_objects, broadcast_object


def _gathers_and_broadcasts():
    rank = dist.get_rank()
    mine = {"rank": rank, "text": "x" * (1000 * rank), "tensor": torch.arange(rank + 1, dtype=torch.float64)}
    world = all_gather_objects(mine)
    pair = dist.new_group([0, 2])  # every rank makes it; rank 1 is not in it
    in_pair = all_gather_objects(("pair", rank), pair) if rank in (0, 2) else None
    from_two = broadcast_object(f"from rank {rank}" if rank == 2 else None, src=2)
    tail = dist.new_group([1, 2])
    from_tail = broadcast_object(["tail", rank], src=2, group=tail) if rank in (1, 2) else None
    nothing = all_gather_objects(b"" if rank == 1 else None)
    return ([(w["rank"], len(w["text"]), w["tensor"].tolist()) for w in world], in_pair, from_two, from_tail,
            nothing)


def test_every_rank_gets_every_object(ranks):
    outcomes = ranks(3).run(_gathers_and_broadcasts, timeout=120)
    world = [(0, 0, [0.0]), (1, 1000, [0.0, 1.0]), (2, 2000, [0.0, 1.0, 2.0])]
    assert outcomes == [
        (world, [("pair", 0), ("pair", 2)], "from rank 2", None, [None, b"", None]),
        (world, None, "from rank 2", ["tail", 2], [None, b"", None]),
        (world, [("pair", 0), ("pair", 2)], "from rank 2", ["tail", 2], [None, b"", None]),
    ], outcomes
