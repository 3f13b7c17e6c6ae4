"""torchpp.parallel.object_collectives: torchpp's object all-gather and broadcast, whose bytes
travel in buffers made in C++ (no Python object on them, so gloo's worker never needs the GIL to
free them while a raising process exits: pytorch/pytorch#190489). On real gloo ranks: every
rank's object in group-rank order, lengths that differ by rank, subgroups, a source that is not
group rank 0; and a guard that torchpp itself uses no torch.distributed object collective."""
import ast
import os

import torch
import torch.distributed as dist

from torchpp.parallel.object_collectives import all_gather_objects, broadcast_object

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TORCH_OBJECT_COLLECTIVES = {"all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
                            "send_object_list", "recv_object_list"}


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


def test_torchpp_calls_no_torch_object_collective():
    """A torch.distributed object collective makes its buffers in Python: an error raised on
    every rank right after one (NonFiniteGradientError, a checkpoint's agreed failure) could
    abort the process instead of exiting with the error. torchpp's go through
    torchpp.parallel.object_collectives."""
    found = []
    for folder, _, files in os.walk(os.path.join(ROOT, "torchpp")):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            for node in ast.walk(ast.parse(open(path).read(), path)):
                if isinstance(node, ast.Attribute) and node.attr in TORCH_OBJECT_COLLECTIVES:
                    found.append(f"{os.path.relpath(path, ROOT)}:{node.lineno} {node.attr}")
    assert not found, found
