"""Stages that pass tuples of tensors, as torch.distributed.pipelining allows: each stage hands
the next one (hidden, skip, positions, keep-mask, gate): two floats that carry gradients, a
long and a bool tensor that travel forward only, and a float the sender detached (its gradient
is computed by the receiver and dropped by the sender). For every schedule, tagged and in
order, and under TP=2 x PP=2 with scatter/gather (the packed message sliced across TP ranks),
losses, every gradient and the eval outputs equal the same stages run in one process. A
first stage that sends integer ids alone (no gradient comes back), and a last stage that
returns a tuple (step and eval return a tuple of concatenated outputs) are covered too."""
from __future__ import annotations

from typing import Tuple

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pipeline_checks import assert_no_rank_errors, local_last_microbatches, run_configs, run_tp_pp
from pipeline_models import linear
from torchpp import schedule as S
from torchpp.pipeline import PipelineStage, build_schedule, split_model
from torchpp.pipeline.microbatch import loss_weights, split_microbatches

FEATURES, POSITIONS, BATCH, M = 8, 5, 16, 8
TOL = dict(rtol=1e-10, atol=1e-12)


class TupleStage(nn.Module):
    """Model stage `index` of `count`; the first takes x [b, s, F], the last returns [b, s, F]."""

    def __init__(self, index: int, count: int, tuple_out: bool = False):
        super().__init__()
        self.first, self.last, self.tuple_out = index == 0, index == count - 1, tuple_out
        self.fc = linear(FEATURES, FEATURES, split=True)
        self.pos = nn.Embedding(POSITIONS, FEATURES)

    def forward(self, h, skip=None, pos=None, keep=None, gate=None):
        if self.first:
            x = h
            pos = (x[..., 0].abs() * 3).long().clamp(max=POSITIONS - 1)
            keep = x[..., 1] > -1.0
            gate = torch.sigmoid(x[..., 2:3]).detach()  # a float the receiver gets without history
            h, skip = self.fc(x), torch.tanh(x + self.pos(pos))  # both carry gradients to pos
        else:
            h = self.fc(h + skip) * (1 + gate) + self.pos(pos)
            h = h.masked_fill(~keep[..., None], 0.0)
            skip = skip + 0.5 * torch.tanh(h)
        if self.last:
            return (h + skip * gate, keep) if self.tuple_out else h + skip * gate
        return h, skip, pos, keep, gate


class IdsFirst(nn.Module):
    """A first stage without parameters that sends integer ids alone: nothing comes back."""

    def forward(self, x):
        return (x[..., 0].abs() * 3).long().clamp(max=POSITIONS - 1)


class EmbedLast(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(POSITIONS, FEATURES)
        self.fc = linear(FEATURES, FEATURES, split=True)

    def forward(self, ids):
        return self.fc(self.emb(ids))


class ScriptFirst(nn.Module):
    """TorchScript stages: the executor passes their tuples from C++, without Python."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(FEATURES, FEATURES)
        self.positions = POSITIONS

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        pos = (x[..., 0].abs() * 3).long().clamp(max=self.positions - 1)
        return self.fc(x), pos, x[..., 1] > -1.0


class ScriptLast(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(FEATURES, FEATURES)
        self.pos = nn.Embedding(POSITIONS, FEATURES)

    def forward(self, h: torch.Tensor, pos: torch.Tensor, keep: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.fc(torch.tanh(h) + self.pos(pos)).masked_fill(~keep[..., None], 0.0), keep


class ScriptLoss(nn.Module):
    def forward(self, output: Tuple[torch.Tensor, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(output[0], target)


def make_stages(model: str, count: int):
    torch.manual_seed(0)
    if model == "ids":
        return [IdsFirst().double(), EmbedLast().double()]
    if model == "script":
        return [ScriptFirst().double(), ScriptLast().double()]
    if model == "split":  # split_model's parts of a model whose blocks pass tuples
        return split_model(TupleModel(8).double(), count)
    return [TupleStage(k, count, tuple_out=model == "tuple_out").double() for k in range(count)]


def first_of(output):
    return output[0] if isinstance(output, tuple) else output


def loss_fn(output, target):
    return F.mse_loss(first_of(output), target)


class TupleModel(nn.Module):
    """A whole model of TupleStage blocks, for split_model."""

    def __init__(self, blocks: int):
        super().__init__()
        self.blocks = nn.ModuleList(TupleStage(k, blocks) for k in range(blocks))

    def forward(self, x):
        return reference_forward(self.blocks, x)


def reference_forward(stages, x):
    out = x
    for stage in stages:
        out = stage(*out) if isinstance(out, tuple) else stage(out)
    return out


def _check(name, model="tuples", in_order=False, pp_group=None, tp_group=None, scatter_gather=True):
    p, pp_rank = dist.get_world_size(pp_group), dist.get_rank(pp_group)
    probe = S.generate(name, num_ranks=p, num_microbatches=M)
    count = probe.num_stages // probe.num_pipelines
    modules, reference = make_stages(model, count), make_stages(model, count)
    mine = sorted({probe.model_stage(s) for s, r in enumerate(probe.stage_to_rank) if r == pp_rank})
    wrap = torch.jit.script if model == "script" else (lambda module: module)
    stages = [PipelineStage(wrap(modules[k]), k, count, "cpu", group=pp_group, tp_group=tp_group) for k in mine]
    sched = build_schedule(name, stages, M, loss_fn=wrap(ScriptLoss()) if model == "script" else loss_fn,
                           in_order_p2p=in_order, scatter_gather=scatter_gather)
    assert sched.torchscript_stages == (model == "script")
    last_mbs = local_last_microbatches(sched)
    reports = tp_group is None or dist.get_rank(tp_group) == 0  # TP ranks compute the same losses
    g = torch.Generator().manual_seed(1)
    outcome = []
    for seq in (4, 6):  # the second step re-exchanges every message's shapes
        x = torch.randn(BATCH, seq, FEATURES, generator=g, dtype=torch.float64)
        y = torch.randn(BATCH, seq, FEATURES, generator=g, dtype=torch.float64)
        for module in modules + reference:
            module.zero_grad(set_to_none=True)
        losses = []
        sched.step(x, target=y, losses=losses)
        ref_out = reference_forward(reference, x)
        ref_loss = loss_fn(ref_out, y)
        ref_loss.backward()
        for k in mine:
            for (pname, want), got in zip(reference[k].named_parameters(), modules[k].parameters()):
                torch.testing.assert_close(got.grad, want.grad, **TOL, msg=lambda m, n=f"stage {k} {pname}": f"{n}: {m}")
        out = sched.eval(x)
        if not last_mbs:
            assert out is None and not losses
            continue
        weights = loss_weights(split_microbatches(y, M))
        if reports:
            outcome.append((sum(weights[i] * loss.item() for i, loss in zip(last_mbs, losses)), ref_loss.item()))
        with torch.no_grad():
            want = reference_forward(reference, x)
        wants = want if isinstance(want, tuple) else (want,)
        gots = out if isinstance(out, tuple) else (out,)
        assert isinstance(out, tuple) == isinstance(want, tuple)
        for got, full in zip(gots, wants):
            parts = split_microbatches(full, M)
            torch.testing.assert_close(got, torch.cat([parts[i] for i in last_mbs]), **TOL)
    return outcome


CONFIGS = [dict(name=n, in_order=o) for n in S.SCHEDULES for o in (False, True)] + [
    dict(name="1f1b", model="ids"), dict(name="zb-h1", model="ids", in_order=True),
    dict(name="1f1b", model="tuple_out"), dict(name="interleaved-1f1b", model="tuple_out"),
    dict(name="1f1b", model="script"), dict(name="zb-h1", model="script", in_order=True),
    dict(name="1f1b", model="split"), dict(name="zb-v", model="split")]
TP_CONFIGS = [dict(name="1f1b", scatter_gather=True), dict(name="zb-h1", scatter_gather=True),
              dict(name="1f1b", scatter_gather=False)]


def _config_id(config):
    return "-".join(str(v) for v in config.values())


def _assert_ok(per_rank):
    assert_no_rank_errors(per_rank)
    shares = [r for r in per_rank if r]
    assert shares, "no rank computed a loss"
    for steps in zip(*shares):  # per step, the ranks' shares of the loss add up to the reference's
        assert sum(share for share, _ in steps) == pytest.approx(steps[0][1], rel=1e-10)


@pytest.fixture(scope="module")
def results(ranks):
    return ranks(2).run(run_configs, CONFIGS, _check, timeout=240)


@pytest.fixture(scope="module")
def tp_results(ranks):
    # TP=2 x PP=2: the stages are replicated over TP, so each TP rank sends 1/2 of the packed
    # message and the receivers all-gather it.
    return ranks(4).run(run_tp_pp, TP_CONFIGS, _check, timeout=240)


@pytest.mark.parametrize("index", range(len(CONFIGS)), ids=[_config_id(c) for c in CONFIGS])
def test_tuple_messages_match_one_process(results, index):
    _assert_ok([r[index] for r in results])


@pytest.mark.parametrize("index", range(len(TP_CONFIGS)), ids=[_config_id(c) for c in TP_CONFIGS])
def test_tuple_messages_under_tp_scatter_gather(tp_results, index):
    _assert_ok([r[index] for r in tp_results])


# torch 2.13 deprecates TorchScript, which torchpp still runs (TorchScript stages).
@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_split_model_parts_pass_tuples_between_blocks():
    torch.manual_seed(0)
    model = TupleModel(6).double()
    x = torch.randn(4, 3, FEATURES, dtype=torch.float64)
    parts = split_model(model, 3)
    torch.testing.assert_close(reference_forward(parts, x), model(x), rtol=0, atol=0)
    plain = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 2))
    first, second = split_model(plain, 2)
    scripted = torch.jit.script(first)  # TorchScript gets a plain nn.Sequential of the same modules
    y = torch.randn(2, 3)
    torch.testing.assert_close(second(scripted(y)), plain(y))
