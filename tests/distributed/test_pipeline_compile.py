"""torch.compile'd stages: the pipeline trains them to one process's gradients, and under
zero-bubble schedules the split-B/W linears' weight gradients still wait for W (the op runs
eagerly between compiled graphs; traced ahead of time, its weight gradient would run in I).
aot_eager is torch.compile's autograd tracing without inductor's C++ build, which a test
suite on two cores cannot afford per case; a manual inductor run behaves the same (docs)."""
from __future__ import annotations

import pytest
import torch

from pipeline_checks import config_results, run_configs
from pipeline_models import lm_loss, make_batches, make_model, stage_split_points
from torchpp import _C
from torchpp.pipeline import PipelineStage, SplitBWLinear, build_schedule, split_model

M, BATCH = 4, 8
SCHEDULES = ["1f1b", "zb-h1"]
TOL = dict(rtol=1e-10, atol=1e-12)


def _check(name, pp_group):
    rank = pp_group.rank()
    model, reference = make_model(2, torch.float64), make_model(2, torch.float64)
    parts = split_model(model, 2, stage_split_points(2, 2))
    stage = PipelineStage(torch.compile(parts[rank], backend="aot_eager"), rank, 2, "cpu", group=pp_group)
    sched = build_schedule(name, stage, M, loss_fn=lm_loss)
    # Where each split weight's gradient lands: inside a deferred (W) accumulation or not. An I
    # pass that parked it still reaches AccumulateGrad, empty: not a gradient (as DP's rule).
    deferred = []

    def record(param):
        if _C.wgrad_in_deferred_accumulate() or _C.wgrad_parked_for(param) == 0:
            deferred.append(_C.wgrad_in_deferred_accumulate())

    for module in parts[rank].modules():
        if isinstance(module, SplitBWLinear):
            module.weight.register_post_accumulate_grad_hook(record)
    (x, y), = make_batches(BATCH, (6,))
    sched.step(x if rank == 0 else None, target=y if rank == 1 else None)
    lm_loss(reference(x), y).backward()
    ref = dict(reference.named_parameters())
    names = {id(p): n for n, p in model.named_parameters()}
    for prm in parts[rank].parameters():
        torch.testing.assert_close(prm.grad, ref[names[id(prm)]].grad, **TOL,
                                   msg=lambda m, n=names[id(prm)]: f"{name} {n}: {m}")
    assert deferred and all(deferred) == (name == "zb-h1") and any(deferred) == (name == "zb-h1"), (name, deferred)
    return len(deferred)


@pytest.fixture(scope="module")
def results(ranks):
    return ranks(2).run(run_configs, [dict(name=n) for n in SCHEDULES], _check, timeout=300)


@pytest.mark.parametrize("index", range(len(SCHEDULES)), ids=SCHEDULES)
def test_compiled_stages_match_one_process_and_keep_w_deferred(results, index):
    assert all(count > 0 for count in config_results(results, index))
