"""Gradient accumulation over several ``step()`` calls: the schedule weights each microbatch's
loss seed by its share of the step's batch and never rescales ``.grad`` after a backward, so
gradients left from an earlier step are untouched and k steps without zero_grad accumulate
the sum of the k batch-mean gradients (fp64, against one process); under DualPipe, whose step
sums gradients with the twin rank's, an earlier step's sum counts once. (torch.distributed.pipelining's
``scale_grads`` divides the accumulated ``.grad`` after each step instead; torchtitan#1732.)"""
from __future__ import annotations

import pytest
import torch

from pipeline_checks import TOLERANCES, build_pipeline, config_results, record_mismatch, run_configs
from pipeline_models import lm_loss, make_batches

M = 4
SCHEDULES = ["1f1b", "zb-h1", "interleaved-1f1b", "dualpipe"]  # dualpipe: gradients summed with the twin rank
BATCHES = [(8, 6), (16, 4), (12, 6)]  # (rows, sequence length) of each accumulated step


def _accumulate(name, pp_group):
    built = build_pipeline(name, torch.float64, M, pp_group, None, True, None)
    model, reference, sched, params = built.model, built.reference, built.sched, built.params
    for k, (rows, seq) in enumerate(BATCHES):
        (x, y), = make_batches(rows, (seq,), seed=10 + k)
        sched.step(x, target=y)  # no zero_grad between steps
        lm_loss(reference(x), y).backward()
    ref_params = dict(reference.named_parameters())
    names = {id(p): n for n, p in model.named_parameters()}
    mismatches = []
    for prm in params:
        record_mismatch(mismatches, prm.grad, ref_params[names[id(prm)]].grad, names[id(prm)],
                        **TOLERANCES[torch.float64])
    return mismatches


@pytest.fixture(scope="module")
def results(ranks):
    return ranks(2).run(run_configs, [dict(name=n) for n in SCHEDULES], _accumulate, timeout=180)


@pytest.mark.parametrize("index", range(len(SCHEDULES)), ids=SCHEDULES)
def test_steps_without_zero_grad_accumulate_the_batch_gradients(results, index):
    for rank, mismatches in enumerate(config_results(results, index)):
        assert mismatches == [], f"rank {rank}"
