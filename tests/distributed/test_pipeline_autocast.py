"""Mixed precision: ``step()`` under ``torch.autocast`` (bf16 on CPU) computes what one process
computes under the same autocast, microbatch by microbatch (``eval()`` too): the stages' forwards and the loss run
in the caller's autocast region, split-B/W linears compute in bf16 and their deferred weight
gradients land in the fp32 ``.grad`` of their parameters."""
from __future__ import annotations

import pytest
import torch

from pipeline_checks import build_pipeline, config_results, local_last_microbatches, run_configs
from pipeline_models import lm_loss, make_batches
from torchpp.pipeline.microbatch import loss_weights, split_microbatches

M, BATCH = 4, 8
SCHEDULES = ["1f1b", "zb-h1", "interleaved-zb"]
TOL = dict(rtol=1e-5, atol=1e-6)


def autocast():
    return torch.autocast("cpu", dtype=torch.bfloat16)


def _check(name, pp_group):
    built = build_pipeline(name, torch.float32, M, pp_group, None, True, None)
    model, reference, sched, params = built.model, built.reference, built.sched, built.params
    (x, y), = make_batches(BATCH, (6,))
    with autocast():
        sched.step(x, target=y)
    # One process, the same microbatches in order, each loss weighted as the pipeline weights it.
    xs, ys = split_microbatches(x, M), split_microbatches(y, M)
    for xk, yk, weight in zip(xs, ys, loss_weights(ys)):
        with autocast():
            loss = lm_loss(reference(xk), yk)
        (loss * weight).backward()
    ref_params = dict(reference.named_parameters())
    names = {id(p): n for n, p in model.named_parameters()}
    for prm in params:
        want = ref_params[names[id(prm)]].grad
        assert prm.grad.dtype == torch.float32, names[id(prm)]
        torch.testing.assert_close(prm.grad, want, **TOL, msg=lambda m, n=names[id(prm)]: f"{name} {n}: {m}")
    # eval() too: this rank's last-stage outputs are the bf16 forwards of one process.
    with autocast():
        out = sched.eval(x)
        with torch.no_grad():
            want = [reference(xk) for xk in xs]
    mine = local_last_microbatches(sched)
    if mine:
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out, torch.cat([want[k] for k in mine]), rtol=0, atol=0)
    # The comparison can fail: without autocast the same step's gradients differ beyond TOL.
    full = {n: p.grad.clone() for n, p in ref_params.items()}
    reference.zero_grad(set_to_none=True)
    for xk, yk, weight in zip(xs, ys, loss_weights(ys)):
        (lm_loss(reference(xk), yk) * weight).backward()
    return max(((full[n] - p.grad).abs().max() / p.grad.abs().max()).item() for n, p in ref_params.items())


@pytest.fixture(scope="module")
def results(ranks):
    return ranks(2).run(run_configs, [dict(name=n) for n in SCHEDULES], _check, timeout=240)


@pytest.mark.parametrize("index", range(len(SCHEDULES)), ids=SCHEDULES)
def test_step_under_autocast_equals_one_process_under_autocast(results, index):
    per_rank = config_results(results, index)
    assert min(per_rank) > 1e-3  # bf16 moved every rank's reference gradients well beyond TOL
