"""Migration by changing imports: the same program, written against
torch.distributed.pipelining's PipelineStage and schedule classes, runs with torchpp's classes
of the same names, and both give the same losses and gradients (and those of one process)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.distributed.pipelining as torch_pp
import torch.nn.functional as F
from torch import nn

import torchpp.pipeline as torchpp_pp
from pipeline_checks import run_configs

FEATURES, BATCH, M = 6, 16, 8
TOL = dict(rtol=1e-10, atol=1e-12)
# class name -> (model stages per rank, the model stages rank r of p holds)
CLASSES = {
    "ScheduleGPipe": (1, lambda r, p: [r]),
    "Schedule1F1B": (1, lambda r, p: [r]),
    "ScheduleInterleaved1F1B": (2, lambda r, p: [r, r + p]),
    "ScheduleLoopedBFS": (2, lambda r, p: [r, r + p]),
    "ScheduleZBVZeroBubble": (2, lambda r, p: [r, 2 * p - 1 - r]),
    "ScheduleDualPipeV": (2, lambda r, p: [r, 2 * p - 1 - r]),
}


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(FEATURES, FEATURES)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


def user_program(pp, class_name, blocks, group, x, y):
    """What a user writes; `pp` is the module it imports from. Returns its stages and losses."""
    per_rank, place = CLASSES[class_name]
    rank, p = dist.get_rank(group), group.size()
    count, mine = per_rank * p, place(rank, p)
    stages = [pp.PipelineStage(blocks[k], k, count, torch.device("cpu"), group=group) for k in mine]
    sched = getattr(pp, class_name)(stages[0] if per_rank == 1 else stages, M, loss_fn=F.mse_loss)
    losses = []
    sched.step(*([x] if 0 in mine else []), target=y if count - 1 in mine else None, losses=losses)
    return mine, losses


def _check(class_name, pp_group):
    torch.manual_seed(0)
    blocks = [Block().double() for _ in range(CLASSES[class_name][0] * pp_group.size())]
    theirs, ours, reference = copy.deepcopy(blocks), copy.deepcopy(blocks), nn.Sequential(*copy.deepcopy(blocks))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, FEATURES, generator=g, dtype=torch.float64)
    y = torch.randn(BATCH, FEATURES, generator=g, dtype=torch.float64)
    mine, torch_losses = user_program(torch_pp, class_name, theirs, pp_group, x, y)
    _, our_losses = user_program(torchpp_pp, class_name, ours, pp_group, x, y)
    F.mse_loss(reference(x), y).backward()
    assert len(our_losses) == len(torch_losses)
    for a, b in zip(our_losses, torch_losses):
        torch.testing.assert_close(a, b, **TOL)
    for k in mine:
        for (name, want), got, torch_got in zip(reference[k].named_parameters(), ours[k].parameters(),
                                                theirs[k].parameters()):
            torch.testing.assert_close(got.grad, torch_got.grad, **TOL, msg=lambda m, n=name: f"{k}.{n} vs torch: {m}")
            torch.testing.assert_close(got.grad, want.grad, **TOL, msg=lambda m, n=name: f"{k}.{n} vs 1 process: {m}")
    return len(our_losses)


@pytest.fixture(scope="module")
def results(ranks):
    return ranks(2).run(run_configs, [dict(class_name=n) for n in CLASSES], _check, timeout=180)


@pytest.mark.parametrize("index", range(len(CLASSES)), ids=list(CLASSES))
def test_torch_program_runs_unchanged_with_torchpp_imports(results, index):
    per_rank = [r[index] for r in results]
    errors = [f"rank {k}:\n{r['error']}" for k, r in enumerate(per_rank) if isinstance(r, dict)]
    assert not errors, "\n".join(errors)
    assert sum(per_rank) == M  # every microbatch's loss came back, on the ranks holding last stages


def test_unsupported_torch_arguments_are_named():
    with pytest.raises(ValueError, match="args_chunk_spec"):
        torchpp_pp.Schedule1F1B(None, M, args_chunk_spec=(object(),))
