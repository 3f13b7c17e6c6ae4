"""torch's tracing frontend, migrated by changing imports: the same program traces a model
with ``pipeline(...)`` and runs ``pipe.build_stage(...)`` stages, once importing from
torch.distributed.pipelining and once from torchpp.pipeline. The model has what a traced pipe
routes past the next stage where torch runs it (a skip into the next stage); both engines give
the losses and gradients of one process. torchpp also runs what torch 2.13 does not, against
one process: a skip from the first stage to every later one under multi-stage schedules
(torch: "only supports adjacent-stage communication"), a late stage reading a step input
(torch hands every step input to the first stage's module, which then fails), and ZB-V (torch's
ZB-V on traced stages stops at a gloo "Pair is not connected" here)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.distributed.pipelining as torch_pp
import torch.nn.functional as F
from torch import nn

import torchpp.pipeline as torchpp_pp
from pipeline_checks import config_results, run_configs

WIDTH, BATCH, M = 8, 16, 4
TOL = dict(rtol=1e-10, atol=1e-12)
# class -> (stages per rank, model stages of rank r of p)
CLASSES = {
    "Schedule1F1B": (1, lambda r, p: [r]),
    "ScheduleInterleaved1F1B": (2, lambda r, p: [r, r + p]),
    "ScheduleZBVZeroBubble": (2, lambda r, p: [r, 2 * p - 1 - r]),
}


class SkipNet(nn.Module):
    """With ``skip`` the embedding feeds every layer (a skip that crosses stages), else each
    layer adds its own input. The gate, a step input, scales the embedding, or with
    ``late_gate`` the output (read by the last stage alone)."""

    def __init__(self, layers: int, skip: bool = True, late_gate: bool = False):
        super().__init__()
        self.skip, self.late_gate = skip, late_gate
        self.embed = nn.Linear(WIDTH, WIDTH)
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(layers))
        self.head = nn.Linear(WIDTH, WIDTH)

    def forward(self, x, gate):
        skip = self.embed(x) if self.late_gate else self.embed(x) * gate
        h = skip
        for layer in self.layers:
            h = torch.tanh(layer(h)) + (skip if self.skip else h)
        return self.head(h) * gate if self.late_gate else self.head(h)


def user_program(pp, class_name, model, group, x, gate, y):
    per_rank, place = CLASSES[class_name]
    rank, p = dist.get_rank(group), group.size()
    count = per_rank * p
    spec = {f"layers.{k}": pp.SplitPoint.BEGINNING for k in range(1, count)}
    pipe = pp.pipeline(model, mb_args=(x[: BATCH // M], gate[: BATCH // M]), split_spec=spec)
    mine = place(rank, p)
    stages = [pipe.build_stage(k, torch.device("cpu"), group=group) for k in mine]
    sched = getattr(pp, class_name)(stages[0] if per_rank == 1 else stages, M, loss_fn=F.mse_loss)
    losses = []
    first = 0 in mine
    sched.step(*([x, gate] if first else []), target=y if count - 1 in mine else None, losses=losses)
    grads = {name: prm.grad for k in mine for name, prm in pipe.get_stage_module(k).named_parameters()}
    return grads, losses


def _check(class_name, pp_group, skip=True, late_gate=False, with_torch=True):
    count = CLASSES[class_name][0] * pp_group.size()
    torch.manual_seed(0)
    model = SkipNet(layers=count, skip=skip, late_gate=late_gate).double()
    g = torch.Generator().manual_seed(1)
    x, gate, y = (torch.randn(BATCH, WIDTH, generator=g, dtype=torch.float64) for _ in range(3))
    ours, our_losses = user_program(torchpp_pp, class_name, copy.deepcopy(model), pp_group, x, gate, y)
    if not with_torch:  # torch cannot run it: compare with one process alone
        theirs, torch_losses = ours, our_losses
    else:
        theirs, torch_losses = user_program(torch_pp, class_name, copy.deepcopy(model), pp_group, x, gate, y)
    F.mse_loss(model(x, gate), y).backward()
    reference = dict(model.named_parameters())
    assert sorted(ours) == sorted(theirs) and ours, (sorted(ours), sorted(theirs))
    for name, grad in ours.items():
        torch.testing.assert_close(grad, reference[name].grad, **TOL, msg=lambda m, n=name: f"{n} vs 1 process: {m}")
        torch.testing.assert_close(grad, theirs[name], **TOL, msg=lambda m, n=name: f"{n} vs torch: {m}")
    assert len(our_losses) == len(torch_losses)
    for a, b in zip(our_losses, torch_losses):
        torch.testing.assert_close(a, b, **TOL)
    return len(our_losses)


CONFIGS = ([dict(class_name="Schedule1F1B")]  # two stages: the skip goes to the next one
           + [dict(class_name="ScheduleInterleaved1F1B", skip=False)]
           + [dict(class_name=n, with_torch=False) for n in CLASSES if n != "Schedule1F1B"]
           + [dict(class_name=n, late_gate=True, with_torch=False) for n in CLASSES])


def _label(config):
    flags = [("no-skip", not config.get("skip", True)), ("late-gate", config.get("late_gate")),
             ("vs-1-process", not config.get("with_torch", True))]
    return "-".join([config["class_name"]] + [name for name, on in flags if on])


@pytest.fixture(scope="module")
def results(ranks):
    return ranks(2).run(run_configs, CONFIGS, _check, timeout=240)


@pytest.mark.parametrize("index", range(len(CONFIGS)), ids=[_label(c) for c in CONFIGS])
def test_traced_program_runs_unchanged_with_torchpp_imports(results, index):
    per_rank = config_results(results, index)
    assert sum(per_rank) == M


def test_chain_passes_on_what_later_stages_read():
    """Stage 1 of 3 receives the skip and the gate from stage 0 and passes both on to stage 2,
    which the traced pipe feeds directly from stage 0 and the step."""
    model = SkipNet(layers=3, late_gate=True)
    x, gate = torch.randn(4, WIDTH), torch.randn(4, WIDTH)
    pipe = torchpp_pp.pipeline(model, (x, gate), split_spec={"layers.1": torchpp_pp.SplitPoint.BEGINNING,
                                                             "layers.2": torchpp_pp.SplitPoint.BEGINNING})
    links = [torchpp_pp.tracing.chain(pipe.info().graph, k, pipe.get_stage_module(k)) for k in range(3)]
    assert links[0].receives == ["x", "gate"]
    assert "gate" in links[1].receives and "gate" in links[1].returns and "gate" in links[2].receives
    out = links[0](x, gate)
    out = links[1](*out)
    torch.testing.assert_close(links[2](*out), model(x, gate))


@pytest.mark.parametrize("name", ["pipeline", "build_stage", "Pipe.build_stage"])
def test_tracing_api_takes_torch_parameters_in_torch_order(name):
    import inspect

    def resolve(module):
        obj = module
        for part in name.split("."):
            obj = getattr(obj, part)
        return list(inspect.signature(obj).parameters)

    theirs, ours = resolve(torch_pp), resolve(torchpp_pp)
    assert ours[: len(theirs)] == theirs
    assert torchpp_pp.SplitPoint is torch_pp.SplitPoint and torchpp_pp.pipe_split is torch_pp.pipe_split
