"""Rank-side programs for test_pipeline_torch_semantics.py: torch.distributed.pipelining's
behaviours, each run with torchpp's classes and compared with one process (fp64)."""
from __future__ import annotations

import copy
import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import torchpp.pipeline as pp
from torchpp.pipeline import schedules as torch_like

WIDTH, BATCH, M = 6, 16, 4
TOL = dict(rtol=1e-10, atol=1e-12)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


class Net(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _data(seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(BATCH, WIDTH, generator=g, dtype=torch.float64),
            torch.randn(BATCH, WIDTH, generator=g, dtype=torch.float64))


def _net(n):
    torch.manual_seed(0)
    return Net(n).double()


def _solo_group():
    """A one-rank group of this rank (every rank takes part in creating each)."""
    groups = [dist.new_group([r]) for r in range(dist.get_world_size())]
    return groups[dist.get_rank()]


def _stages(net, mine, group):
    n = len(net.layers)
    return [pp.PipelineStage(net.layers[k], k, n, torch.device("cpu"), group=group) for k in mine]


def _assert_grads(net, reference, mine, what):
    for k in mine:
        for (name, got), want in zip(net.layers[k].named_parameters(), reference.layers[k].parameters()):
            torch.testing.assert_close(got.grad, want.grad, **TOL, msg=lambda m, n=name: f"{what}: layers.{k}.{n}: {m}")


def losses_refilled_each_step(pp_group):
    """One ``losses`` list over two steps holds the second step's M losses (torch clears it)."""
    rank = pp_group.rank()
    net, x, y = _net(2), *_data()
    reference = copy.deepcopy(net)
    sched = pp.Schedule1F1B(_stages(net, [rank], pp_group)[0], M, loss_fn=F.mse_loss)
    losses = ["stale"]
    for step in range(2):
        net.zero_grad()
        sched.step(*([x] if rank == 0 else []), target=y if rank == 1 else None, losses=losses)
    want = [F.mse_loss(reference(xm), ym).detach() for xm, ym in zip(x.chunk(M), y.chunk(M))]
    if rank == 1:
        assert len(losses) == M, losses
        for got, w in zip(losses, want):
            torch.testing.assert_close(got, w, **TOL)
    else:
        assert losses == ["stale"], losses  # a rank without the last stage leaves it alone
    reference.zero_grad()
    F.mse_loss(reference(x), y).backward()
    _assert_grads(net, reference, [rank], "second step")
    return len(losses)


def forward_only_without_loss_fn(pp_group, class_name="ScheduleGPipe", with_loss_fn=False):
    """loss_fn=None (or _ScheduleForwardOnly, whatever its loss_fn): step is a forward pass;
    the last stage returns the outputs, no gradient."""
    rank = pp_group.rank()
    net, x, _ = _net(2), *_data()
    sched = getattr(pp, class_name)(_stages(net, [rank], pp_group)[0], M,
                                    loss_fn=F.mse_loss if with_loss_fn else None)
    outs = [sched.step(*([x] if rank == 0 else [])) for _ in range(2)]
    assert all(p.grad is None for p in net.parameters())
    if rank == 1:
        with torch.no_grad():
            torch.testing.assert_close(outs[1], net(x), **TOL)
        assert len(sched.stages[0].output_chunks) == M
    else:
        assert outs == [None, None]
    return True


def eval_then_train_one_object(pp_group, class_name):
    """eval() (losses, no gradient) then step() on the same schedule object; two stages a rank."""
    rank, p = pp_group.rank(), pp_group.size()
    n = 2 * p
    mine = [rank, rank + p] if class_name != "ScheduleZBVZeroBubble" else [rank, 2 * p - 1 - rank]
    net, x, y = _net(n), *_data()
    reference = copy.deepcopy(net)
    sched = getattr(pp, class_name)(_stages(net, mine, pp_group), M, loss_fn=F.mse_loss)
    has_first, has_last = 0 in mine, n - 1 in mine
    args = [x] if has_first else []
    losses = []
    with torch.no_grad():
        out = sched.eval(*args, target=y if has_last else None, losses=losses)
    assert all(prm.grad is None for prm in net.parameters())
    if has_last:
        with torch.no_grad():
            want = reference(x)
        torch.testing.assert_close(out, want, **TOL)
        assert len(losses) == M
        torch.testing.assert_close(torch.stack(losses).mean(), F.mse_loss(want, y), **TOL)
    out = sched.step(*args, target=y if has_last else None, losses=losses, return_outputs=False)
    assert out is None
    F.mse_loss(reference(x), y).backward()
    _assert_grads(net, reference, mine, f"{class_name} train after eval")
    return sorted(mine)


def sum_loss_without_scaling(pp_group):
    """scale_grads=False with a summed loss gives the gradient of the summed batch loss."""
    rank = pp_group.rank()
    net, x, y = _net(2), *_data()
    reference = copy.deepcopy(net)
    loss_fn = nn.MSELoss(reduction="sum")
    sched = pp.ScheduleGPipe(_stages(net, [rank], pp_group)[0], M, loss_fn=loss_fn, scale_grads=False)
    losses = []
    sched.step(*([x] if rank == 0 else []), target=y if rank == 1 else None, losses=losses)
    ref_loss = loss_fn(reference(x), y)
    ref_loss.backward()
    if rank == 1:
        torch.testing.assert_close(sum(losses), ref_loss.detach(), **TOL)
    _assert_grads(net, reference, [rank], "scale_grads=False")
    return True


def traced_stage_keeps_names(pp_group):
    """pipeline(): stage modules keep the model's parameter names; Pipe is an nn.Module that
    runs the model; 1F1B over traced stages equals one process, kwargs reaching stage 0."""
    rank = pp_group.rank()

    class WithKwarg(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(Block() for _ in range(2))

        def forward(self, x, shift):
            return self.layers[1](self.layers[0](x + shift))

    torch.manual_seed(0)
    model = WithKwarg().double()
    reference = copy.deepcopy(model)
    x, y = _data()
    shift = torch.full((BATCH, WIDTH), 0.5, dtype=torch.float64)
    pipe = pp.pipeline(model, mb_args=(x.chunk(M)[0],), mb_kwargs={"shift": shift.chunk(M)[0]},
                       split_spec={"layers.1": pp.SplitPoint.BEGINNING})
    assert isinstance(pipe, nn.Module)
    torch.testing.assert_close(pipe(x, shift=shift)[0], reference(x, shift), **TOL)
    assert pipe.to(torch.float64) is pipe
    stage = pipe.build_stage(rank, torch.device("cpu"), group=pp_group)
    keys = set(stage.submod.state_dict())
    assert keys and keys <= set(model.state_dict()), keys
    sched = pp.Schedule1F1B(stage, M, loss_fn=F.mse_loss)
    losses = []
    sched.step(*([x] if rank == 0 else []), **({"shift": shift} if rank == 0 else {}),
               target=y if rank == 1 else None, losses=losses)
    F.mse_loss(reference(x, shift), y).backward()
    ref_params = dict(reference.named_parameters())
    for name, prm in pipe.get_stage_module(rank).named_parameters():
        torch.testing.assert_close(prm.grad, ref_params[name].grad, **TOL, msg=lambda m, n=name: f"{n}: {m}")
    return sorted(keys)


class VShaped(pp.PipelineScheduleMulti):
    """A schedule of one's own, torch's way: a PipelineScheduleMulti subclass that sets
    pipeline_order (4 stages on 2 ranks in a V, two microbatches, split backward)."""

    def __init__(self, stages, n_microbatches, loss_fn=None, scale_grads=True):
        super().__init__(stages=stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=scale_grads)
        F_, I_, W_ = torch_like.F, torch_like.I, torch_like.W
        A = torch_like._Action
        self.pipeline_order = {
            0: [A(0, F_, 0), A(0, F_, 1), None, A(3, F_, 0), A(3, I_, 0), A(3, F_, 1), A(3, I_, 1), A(3, W_, 0),
                A(3, W_, 1), None, A(0, I_, 0), A(0, I_, 1), A(0, W_, 0), A(0, W_, 1)],
            1: [None, A(1, F_, 0), A(2, F_, 0), A(1, F_, 1), A(2, F_, 1), None, None, A(2, I_, 0), A(2, I_, 1),
                A(1, I_, 0), A(1, I_, 1), A(2, W_, 0), A(2, W_, 1), A(1, W_, 0), A(1, W_, 1)],
        }
        self._validate_and_set_stage_mapping(self.pipeline_order)


def own_schedules(pp_group, how):
    """A schedule of one's own runs on torchpp's executor: a PipelineScheduleMulti subclass
    ("subclass"), a _PipelineScheduleRuntime loading a CSV torch-style ("csv", "csv_comms":
    written with SEND/RECV by another schedule's _dump_csv), or a _PipelineScheduleRuntime
    subclass assigning pipeline_order_with_comms ("comms_attr", two steps without zero_grad)."""
    rank = pp_group.rank()
    net, x, y = _net(4), *_data()
    reference = copy.deepcopy(net)
    mine = [rank, 3 - rank]
    stages = _stages(net, mine, pp_group)
    m = 2 if how in ("subclass", "comms_attr") else M
    if how == "subclass":
        sched = VShaped(stages, m, loss_fn=F.mse_loss)
        assert sched.stage_index_to_group_rank == {0: 0, 1: 1, 2: 1, 3: 0}
    elif how == "comms_attr":
        sched = VShapedWithComms(stages, m, loss_fn=F.mse_loss)
    else:
        source = pp.ScheduleZBVZeroBubble(_stages(copy.deepcopy(net), mine, pp_group), m, loss_fn=F.mse_loss)
        path = os.path.join(tempfile.gettempdir(), f"torchpp_own_{os.getpid()}.csv")
        source._dump_csv(path, format="compute_comms" if how == "csv_comms" else "compute_only")
        sched = torch_like._PipelineScheduleRuntime(stages, m, loss_fn=F.mse_loss)
        sched._load_csv(path, format="compute_comms" if how == "csv_comms" else "compute_only")
        os.remove(path)
        assert sched.pipeline_order == source.pipeline_order
    losses = []
    accumulate = how == "comms_attr"  # no zero_grad between steps: .grad sums both, as in torch
    for _ in range(2):  # the second step reuses the executor built by the first
        if not accumulate:
            net.zero_grad()
        sched.step(*([x] if rank == 0 else []), target=y if rank == 0 else None, losses=losses)
    for _ in range(2 if accumulate else 1):
        F.mse_loss(reference(x), y).backward()
    _assert_grads(net, reference, mine, how)
    if rank == 0:
        want = [F.mse_loss(o, t) for o, t in zip(reference(x).chunk(m), y.chunk(m))]
        torch.testing.assert_close(torch.stack(losses), torch.stack(want).detach(), **TOL)
    return len(losses)


class VShapedWithComms(torch_like._PipelineScheduleRuntime):
    """torch's other way to a schedule of one's own: a _PipelineScheduleRuntime subclass that
    assigns pipeline_order_with_comms, SEND/RECV included (the V of VShaped, full backward)."""

    def __init__(self, stages, n_microbatches, loss_fn=None):
        super().__init__(stages, n_microbatches, loss_fn=loss_fn)
        self.pipeline_order_with_comms = {
            0: ["0F0", "0F1", "0SEND_F0", "0SEND_F1", "3RECV_F0", "3RECV_F1", "3F0", "3F1", "3B0", "3B1",
                "3SEND_B0", "3SEND_B1", "0RECV_B0", "0RECV_B1", "0B0", "0B1"],
            1: ["1RECV_F0", "1RECV_F1", "1F0", "1F1", "2F0", "2F1", "2SEND_F0", "2SEND_F1", "2RECV_B0", "2RECV_B1",
                "2B0", "2B1", "1B0", "1B1", "1SEND_B0", "1SEND_B1"],
        }


def single_stage_on_one_rank(pp_group, class_name):
    """A one-rank group holding the whole model as one stage: torch's single-stage case, every
    class (the multi-stage ones run their one-chunk schedule); eval, then train twice."""
    solo = _solo_group()
    net, x, y = _net(1), *_data()
    reference = copy.deepcopy(net)
    stage = _stages(net, [0], solo)
    sched = getattr(pp, class_name)(stage[0] if class_name in ("Schedule1F1B", "ScheduleGPipe") else stage, 2,
                                    loss_fn=F.mse_loss)
    losses = []
    sched.eval(x, target=y, losses=losses)
    for _ in range(2):
        net.zero_grad()
        out = sched.step(x, target=y, losses=losses)
    ref_out = reference(x)
    F.mse_loss(ref_out, y).backward()
    torch.testing.assert_close(out, ref_out.detach(), **TOL)
    torch.testing.assert_close(torch.stack(losses).mean(), F.mse_loss(ref_out, y).detach(), **TOL)
    _assert_grads(net, reference, [0], class_name)
    return len(losses)


def chunks_by_hand(pp_group):
    """torch's per-microbatch stage methods, driven by hand for two stages on one rank: 1F1B
    order with split backward (I then W) on stage 1, dw_builder on stage 0."""
    solo = _solo_group()
    torch.manual_seed(0)
    net = nn.Sequential(pp.SplitBWLinear(WIDTH, WIDTH), nn.Tanh(), pp.SplitBWLinear(WIDTH, WIDTH)).double()
    reference = copy.deepcopy(net)
    x, y = _data()
    runs = []

    def dw_builder():
        runs.append(1)
        return lambda: None  # stage 0's gradients all land in I here: nothing is left for W

    s0 = pp.PipelineStage(net[:2], 0, 2, torch.device("cpu"), group=solo, dw_builder=dw_builder)
    s1 = pp.PipelineStage(net[2:], 1, 2, torch.device("cpu"), group=solo)
    for mb, (xm, ym) in enumerate(zip(x.chunk(M), y.chunk(M))):
        s1.set_local_fwd_input(s0.forward_one_chunk(mb, (xm,)), mb)
        loss = F.mse_loss(s1.forward_one_chunk(mb, ()), ym) / M
        s1.backward_one_chunk(mb, loss=loss, full_backward=False)
        assert net[2].weight.grad is None or mb > 0  # the weight gradient waits for W
        s1.backward_weight_one_chunk(mb)
        s0.set_local_bwd_input(s1.get_local_bwd_output(mb), mb)
        s0.backward_one_chunk(mb, full_backward=True)
    F.mse_loss(reference(x), y).backward()
    for got, want in zip(net.parameters(), reference.parameters()):
        torch.testing.assert_close(got.grad, want.grad, **TOL)
    assert len(runs) == M and len(s1.output_chunks) == M and not s0.fwd_cache and not s1.dw_runner
    try:
        s1.backward_weight_one_chunk(0)
    except AssertionError as error:
        assert "backward_one_chunk" in str(error)
    else:
        raise AssertionError("a second W of microbatch 0 was accepted")
    s1.clear_runtime_states()
    assert s1.output_chunks == []
    return True
