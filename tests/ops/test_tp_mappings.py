"""Every TP/SP mapping of torch.ops.torchpp against a reference built without torchpp.

Inputs are integer-valued floats, so sums are exact and results must be torch.equal, as in
Megatron's own mapping tests. Each check runs on real gloo ranks (world sizes 2 and 4).
"""
import pytest
import torch
import torch.distributed as dist

import torchpp.ops as O

SHAPE = (4, 8, 12)  # every dim divisible by 2 and 4


def _int_tensor(seed, shape=SHAPE, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-8, 8, shape, generator=g).to(dtype)


def _per_rank(seed, world, **kw):
    return [_int_tensor(seed * 100 + r, **kw) for r in range(world)]


def check_mapping(name, dim, dtype, device="cpu"):
    rank, world = dist.get_rank(), dist.get_world_size()
    xs = [t.to(device) for t in _per_rank(1, world, dtype=dtype)]  # each rank's input
    gs_full = [t.to(device) for t in _per_rank(2, world, dtype=dtype)]  # each rank's gradient for a full-size output
    shard = lambda t: t.chunk(world, dim)[rank]  # noqa: E731
    x = xs[rank].clone().requires_grad_()

    if name == "copy_to_tp_region":
        y, want_y = O.copy_to_tp_region(x), xs[rank]
        g = gs_full[rank]
        want_grad = sum(gs_full)
    elif name == "reduce_from_tp_region":
        y, want_y = O.reduce_from_tp_region(x), sum(xs)
        g = gs_full[rank]
        want_grad = g
    elif name in ("scatter_to_tp_region", "scatter_to_sp_region"):
        x = xs[0].clone().requires_grad_()  # a replicated input
        y = getattr(O, name)(x, dim=dim)
        want_y = shard(xs[0])
        gs = [g.chunk(world, dim)[r] for r, g in enumerate(gs_full)]
        g = gs[rank]
        want_grad = torch.cat(gs, dim)
    elif name == "gather_from_tp_region":
        y, want_y = O.gather_from_tp_region(x, dim=dim), torch.cat(xs, dim)
        g = torch.cat([gs_full[rank]] * world, dim)
        want_grad = shard(g)
    elif name == "gather_from_sp_region":
        y, want_y = O.gather_from_sp_region(x, dim=dim), torch.cat(xs, dim)
        grads = [torch.cat([gs_full[r]] * world, dim) for r in range(world)]
        g = grads[rank]
        want_grad = shard(sum(grads))
    elif name == "reduce_scatter_to_sp_region":
        y, want_y = O.reduce_scatter_to_sp_region(x, dim=dim), shard(sum(xs))
        gs = [g.chunk(world, dim)[r] for r, g in enumerate(gs_full)]
        g = gs[rank]
        want_grad = torch.cat(gs, dim)
    else:
        raise AssertionError(name)

    assert y.dtype == dtype and torch.equal(y, want_y), f"{name} forward differs on rank {rank}"
    y.backward(g)
    assert torch.equal(x.grad, want_grad), f"{name} backward differs on rank {rank}"
    return True


MAPPINGS = [
    "copy_to_tp_region",
    "reduce_from_tp_region",
    "scatter_to_tp_region",
    "gather_from_tp_region",
    "scatter_to_sp_region",
    "gather_from_sp_region",
    "reduce_scatter_to_sp_region",
]


def check_all_mappings(device="cpu", dtypes=(torch.float32, torch.float64)):
    for name in MAPPINGS:
        for dim in (0, 1, -1):
            for dtype in dtypes:
                check_mapping(name, dim, dtype, device)
    return True


@pytest.mark.parametrize("world_size", [2, 4])
def test_mappings_exact(ranks, world_size):
    assert ranks(world_size).run(check_all_mappings) == [True] * world_size


def check_opcheck():
    group = dist.group.WORLD
    name, size = group.group_name, group.size()
    x = _int_tensor(7).requires_grad_()
    strided = _int_tensor(7, shape=(SHAPE[1], SHAPE[0], SHAPE[2])).transpose(0, 1).requires_grad_()
    samples = {
        "copy_to_tp_region": (x, name),
        "reduce_from_tp_region": (x, name),
        "scatter_to_tp_region": (x, name, size, -1),
        "gather_from_tp_region": (x, name, size, 1),
        "scatter_to_sp_region": (x, name, size, 0),
        "gather_from_sp_region": (x, name, size, 0),
        "reduce_scatter_to_sp_region": (x, name, size, 0),
    }
    for op_name, args in samples.items():
        torch.library.opcheck(getattr(torch.ops.torchpp, op_name).default, args)
        # (a transposed input: the fake kernels must give the real outputs' strides)
        torch.library.opcheck(getattr(torch.ops.torchpp, op_name).default, (strided, *args[1:]))
    return True


def test_opcheck_in_ranks(ranks):
    assert ranks(2).run(check_opcheck) == [True, True]


def check_fake_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(8, 6)
        assert torch.ops.torchpp.gather_from_sp_region(x, "unused", 4, 0).shape == (32, 6)
        assert torch.ops.torchpp.scatter_to_tp_region(x, "unused", 2, -1).shape == (8, 3)
        assert torch.ops.torchpp.reduce_scatter_to_sp_region(x, "unused", 4, 0).shape == (2, 6)
    meta = torch.empty(8, 6, device="meta")
    assert torch.ops.torchpp.gather_from_tp_region(meta, "unused", 3, 1).shape == (8, 18)
    return True


def test_fake_kernels_never_touch_a_group():
    # Runs without any process group: shapes come from the explicit group_size alone.
    assert check_fake_shapes()


class ScriptedTPBlock(torch.nn.Module):
    def __init__(self, group_name: str, group_size: int):
        super().__init__()
        self.group_name = group_name
        self.group_size = group_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.torchpp.copy_to_tp_region(x, self.group_name)
        y = torch.ops.torchpp.gather_from_sp_region(y * 2.0, self.group_name, self.group_size, 0)
        return torch.ops.torchpp.reduce_from_tp_region(y, self.group_name)


def check_torchscript():
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    scripted = torch.jit.script(ScriptedTPBlock(group.group_name, world))
    xs = _per_rank(3, world)
    x = xs[rank].clone().requires_grad_()
    y = scripted(x)
    assert torch.equal(y, world * 2.0 * torch.cat(xs, 0))
    g = _int_tensor(4, shape=y.shape)  # the same gradient on every rank
    y.backward(g)
    # backward: identity; reduce-scatter (rank r keeps world * chunk r); times 2; all-reduce sums the chunks.
    want = 2.0 * world * sum(g.chunk(world, 0))
    assert torch.equal(x.grad, want)
    return True


def test_torchscript_forward_backward(ranks):
    assert ranks(2).run(check_torchscript) == [True, True]


def _raises(fn, *fragments):
    try:
        fn()
    except Exception as error:  # noqa: BLE001
        message = str(error)
        missing = [f for f in fragments if f not in message]
        assert not missing, f"error message {message!r} lacks {missing}"
        return message
    raise AssertionError("no error raised")


def check_bad_input():
    from torchpp.tensor_parallel import ColumnParallelLinear

    world = dist.get_world_size()
    group = dist.group.WORLD
    odd = torch.ones(3, 5)
    _raises(lambda: O.scatter_to_tp_region(odd), "dimension -1 of size 5", f"group size {world}")
    _raises(lambda: O.reduce_scatter_to_sp_region(odd), "dimension 0 of size 3", f"group size {world}")
    _raises(lambda: torch.ops.torchpp.reduce_from_tp_region(odd, "no-such-group"), "'no-such-group'")
    _raises(lambda: torch.ops.torchpp.copy_to_tp_region(odd, "no-such-group"), "'no-such-group'")
    _raises(lambda: O.copy_to_tp_region(odd, "no-such-group"), "'no-such-group'")
    _raises(
        lambda: torch.ops.torchpp.gather_from_tp_region(odd, group.group_name, world + 1, 0),
        f"has {world} ranks", f"group_size={world + 1}",
    )
    layer = ColumnParallelLinear(4, 4 * world)
    _raises(lambda: layer(torch.ones(2, 4, device="meta")), "'meta'", "'cpu'")
    _raises(lambda: ColumnParallelLinear(4, 4 * world + 1), f"out_features={4 * world + 1}", str(world))
    return True


@pytest.mark.parametrize("world_size", [2, 4])
def test_bad_input_raises_clearly(ranks, world_size):
    assert ranks(world_size).run(check_bad_input, timeout=60) == [True] * world_size
