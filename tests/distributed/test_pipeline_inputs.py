"""A first stage with further positional and keyword arguments (a mask, a scale, a shift), as
torch.distributed.pipelining's step(*args, **kwargs): tensors split into microbatches with the
batch, anything else passed as is; losses, gradients and eval outputs equal one process."""
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pipeline_checks import config_results, run_configs
from torchpp.pipeline import PipelineStage, build_schedule

FEATURES, BATCH, M = 6, 12, 4
SCHEDULES = ("1f1b", "zb-h1", "gpipe")


class MaskedFirst(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(FEATURES, FEATURES)

    def forward(self, x, mask, scale=1.0, *, shift=None):
        h = self.fc(x * mask) * scale
        return h if shift is None else h + shift


def _check(name, pp_group):
    rank = dist.get_rank()
    torch.manual_seed(0)
    first, last = MaskedFirst().double(), nn.Linear(FEATURES, FEATURES).double()
    ref_first, ref_last = copy.deepcopy(first), copy.deepcopy(last)
    stage = PipelineStage(first if rank == 0 else last, rank, 2, "cpu", group=pp_group)
    sched = build_schedule(name, stage, M, loss_fn=F.mse_loss)
    g = torch.Generator().manual_seed(3)
    x, y, shift = (torch.randn(BATCH, FEATURES, generator=g, dtype=torch.float64) for _ in range(3))
    mask = (torch.rand(BATCH, FEATURES, generator=g) > 0.3).double()
    losses = []
    sched.step(x, mask, 0.5, target=y, losses=losses, shift=shift)
    ref_out = ref_last(ref_first(x, mask, 0.5, shift=shift))
    F.mse_loss(ref_out, y).backward()
    mine, ref = (first, ref_first) if rank == 0 else (last, ref_last)
    for (pname, want), got in zip(ref.named_parameters(), mine.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-10, atol=1e-12, msg=lambda m, n=pname: f"{n}: {m}")
    # eval with the kwarg left out: the default applies to every microbatch.
    out = sched.eval(x, mask, 2.0, target=y)
    with torch.no_grad():
        want = ref_last(ref_first(x, mask, 2.0))
    if rank == 1:
        torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-12)
        return sum(loss.item() for loss in losses) / M, F.mse_loss(ref_out, y).item()
    return None


@pytest.fixture(scope="module")
def results(ranks):
    return ranks(2).run(run_configs, [dict(name=n) for n in SCHEDULES], _check, timeout=120)


@pytest.mark.parametrize("index", range(len(SCHEDULES)), ids=SCHEDULES)
def test_first_stage_arguments_are_split_like_the_batch(results, index):
    per_rank = config_results(results, index)
    loss, reference = per_rank[1]
    assert loss == pytest.approx(reference, rel=1e-10)
