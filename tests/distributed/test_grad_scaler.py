"""fp16 loss scaling through the pipeline (``grad_scaler=``) and its skip decision shared by every
rank (torchpp.parallel.GradScaler), against torch.amp.GradScaler in one process.

- Pipeline alone, under fp16 autocast: each step's losses, unscaled gradients, parameters and
  scale equal one process scaling each microbatch's loss with torch's GradScaler. Step 1
  overflows fp16 (skipped everywhere); step 3 gets an inf planted in one last-stage gradient
  only, and the first stage's rank, whose own gradients are finite, skips it too.
- PTD-P with DistributedOptimizer (DP all-reduce or ZeRO-1, TP, clipping), fp32 so the
  comparison is exact: an inf planted on global rank 0 alone makes every rank skip that step,
  and the losses follow one process that skips the same step.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from pipeline_checks import (TOLERANCES, build_pipeline, config_results, local_last_microbatches, record_mismatch,
                             run_configs)
from pipeline_models import lm_loss, make_batches
from torchpp.parallel import DistributedOptimizer, GradScaler
from torchpp.pipeline import Schedule1F1B
from torchpp.pipeline.microbatch import loss_weights, split_microbatches

M, BATCH = 4, 8
PIPELINE_SCHEDULES = ["1f1b", "zb-h1"]  # 1f1b through torch's class name, Schedule1F1B
# init 2^24 overflows fp16 at once; backoff 2^-8 and growth x2 every good step then give:
SCALER = dict(init_scale=2.0**24, backoff_factor=2.0**-8, growth_factor=2.0, growth_interval=1)
EXPECTED_SKIPS = [True, False, True, False]  # step 1: fp16 overflow; step 3: the planted inf
EXPECTED_SCALES = [2.0**16, 2.0**17, 2.0**9, 2.0**10]
PLANT_STEP = 2
TOL = TOLERANCES[torch.float32]


def _fp16():
    return torch.autocast("cpu", dtype=torch.float16)


def _pipeline_check(name, pp_group):
    scaler = GradScaler("cpu", group=pp_group, **SCALER)
    schedule_class = Schedule1F1B if name == "1f1b" else None
    built = build_pipeline(name, torch.float32, M, pp_group, None, True, None, schedule_class, grad_scaler=scaler)
    model, reference, sched, params = built.model, built.reference, built.sched, built.params
    ref_scaler = torch.amp.GradScaler("cpu", **SCALER)
    optimizer = torch.optim.SGD(params, lr=0.1)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    ref_params = dict(reference.named_parameters())
    planted = "head.weight"  # on the last stage only
    mine = local_last_microbatches(sched)
    skips, scales, mismatches = [], [], []
    for step, (x, y) in enumerate(make_batches(BATCH, (6,) * len(EXPECTED_SKIPS))):
        optimizer.zero_grad(set_to_none=True)
        ref_optimizer.zero_grad(set_to_none=True)
        losses = []
        with _fp16():
            sched.step(x, target=y, losses=losses)
        xs, ys = split_microbatches(x, M), split_microbatches(y, M)
        ref_losses = []
        for xk, yk, weight in zip(xs, ys, loss_weights(ys)):
            with _fp16():
                loss = lm_loss(reference(xk), yk)
            ref_losses.append(loss.detach())
            ref_scaler.scale(loss * weight).backward()
        if mine:  # the schedule reports unscaled losses
            record_mismatch(mismatches, torch.stack(losses), torch.stack([ref_losses[k] for k in mine]),
                            f"step {step} losses", **TOL)
        if step == PLANT_STEP:
            ref_params[planted].grad[0, 0] = float("inf")
            for prm in params:
                if names[id(prm)] == planted:
                    prm.grad[0, 0] = float("inf")
        scaler.unscale_(optimizer)
        ref_scaler.unscale_(ref_optimizer)
        skipped = scaler.found_inf(optimizer)
        if not skipped:  # unscaled gradients, as one process has them
            for prm in params:
                record_mismatch(mismatches, prm.grad, ref_params[names[id(prm)]].grad,
                                f"step {step} {names[id(prm)]}.grad", **TOL)
        scaler.step(optimizer)
        ref_scaler.step(ref_optimizer)
        scaler.update()
        ref_scaler.update()
        for prm in params:
            record_mismatch(mismatches, prm.detach(), ref_params[names[id(prm)]].detach(),
                            f"step {step} {names[id(prm)]}", **TOL)
        skips.append(skipped)
        scales.append((scaler.get_scale(), ref_scaler.get_scale()))
    return {"skips": skips, "scales": scales, "mismatches": mismatches}


@pytest.fixture(scope="module")
def pipeline_results(ranks):
    return ranks(2).run(run_configs, [dict(name=n) for n in PIPELINE_SCHEDULES], _pipeline_check, timeout=240)


@pytest.mark.parametrize("index", range(len(PIPELINE_SCHEDULES)), ids=PIPELINE_SCHEDULES)
def test_pipeline_fp16_loss_scaling_equals_torch_grad_scaler(pipeline_results, index):
    for rank, result in enumerate(config_results(pipeline_results, index)):
        assert result["mismatches"] == [], f"rank {rank}"
        assert result["skips"] == EXPECTED_SKIPS, f"rank {rank}"
        assert result["scales"] == [(s, s) for s in EXPECTED_SCALES], f"rank {rank}: (torchpp, torch) scales"


# ---- PTD-P: DistributedOptimizer(grad_scaler=...) over dp x pp x tp ----

STEPS, SKIPPED_STEP, LR, MAX_NORM = 3, 1, 1e-2, 0.5
PTDP_SCALER = dict(init_scale=2.0**10, growth_interval=1)


def _gpt(split_bw, group):
    from torchpp.models.gpt import GPT, GPTConfig

    torch.manual_seed(11)
    config = GPTConfig(vocab_size=32, hidden_size=16, num_heads=4, num_layers=4, max_seq_len=8, split_bw=split_bw)
    return GPT(config, group=group)


def _data():
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, 32, (BATCH, 8), generator=g), torch.randint(0, 32, (BATCH, 8), generator=g)


def _reference_losses():
    """One process, fp32, full batch: clip and AdamW, skipping step SKIPPED_STEP."""
    from tp_reference import singleton_group, train_reference

    alone = singleton_group()
    tokens, labels = _data()
    model = _gpt(False, alone)
    return train_reference(model, tokens, labels, alone, STEPS, LR, MAX_NORM, skip_steps=(SKIPPED_STEP,))[0]


def _ptdp_check(dp, pp, tp, schedule, zero):
    from torchpp.models.gpt import gpt_loss
    from torchpp.parallel import finalize_grads, init_parallel
    from torchpp.pipeline import PipelineStage, build_schedule, split_model

    reference = _reference_losses()
    state = init_parallel(tp=tp, pp=pp, dp=dp)
    model = _gpt(schedule == "zb-h1", state.tp_group)
    parts = split_model(model, pp)
    stage = PipelineStage(parts[state.pp_rank], state.pp_rank, pp, torch.device("cpu"), group=state.pp_group,
                          tp_group=state.tp_group)
    params = list(parts[state.pp_rank].parameters())
    scaler = GradScaler("cpu", **PTDP_SCALER)
    loss_fn = lambda logits, labels: gpt_loss(logits, labels, state.tp_group)  # noqa: E731
    pipeline = build_schedule(schedule, stage, M, loss_fn=loss_fn, grad_scaler=scaler)
    optimizer = DistributedOptimizer(params, torch.optim.AdamW, state, zero=zero, max_norm=MAX_NORM,
                                     accumulations_per_step=M, bucket_bytes=2048, grad_scaler=scaler, lr=LR)
    tokens, labels = _data()
    rows = slice(state.dp_rank * BATCH // dp, (state.dp_rank + 1) * BATCH // dp)
    last = state.pp_rank == pp - 1
    skips, scales, mismatches = [], [], []
    for step in range(STEPS):
        optimizer.zero_grad()
        losses = []
        pipeline.step(tokens[rows], target=labels[rows], losses=losses)
        finalize_grads([parts[state.pp_rank]], state)
        if step == SKIPPED_STEP and dist.get_rank() == 0:  # one rank's gradient only: the others are finite
            params[0].grad.view(-1)[0] = float("inf")
        optimizer.step()
        skips.append(optimizer.last_step_skipped)
        scales.append(scaler.get_scale())
        if last:
            step_loss = torch.stack(losses).mean()
            dist.all_reduce(step_loss, group=state.dp_group)
            record_mismatch(mismatches, step_loss / dp, reference[step], f"step {step} loss", **TOL)
    return {"skips": skips, "scales": scales, "mismatches": mismatches}


@pytest.mark.parametrize("dp,pp,tp,schedule,zero", [
    (2, 2, 1, "1f1b", False),
    (2, 2, 1, "zb-h1", True),
    (1, 2, 2, "zb-h1", False),
])
def test_distributed_optimizer_skips_on_every_rank_together(ranks, dp, pp, tp, schedule, zero):
    results = ranks(dp * pp * tp).run(_ptdp_check, dp, pp, tp, schedule, zero, timeout=240)
    for rank, result in enumerate(results):
        # Step 1's inf was on rank 0 alone; every rank skipped it and backed off the same scale.
        assert result == {"skips": [False, True, False], "scales": [2.0**11, 2.0**10, 2.0**11], "mismatches": []}, \
            f"rank {rank}"


def test_distributed_optimizer_refuses_a_scaler_that_does_not_agree_across_ranks():
    with pytest.raises(TypeError, match=r"torch\.amp\.grad_scaler\.GradScaler"):
        DistributedOptimizer([torch.nn.Parameter(torch.zeros(2))], torch.optim.SGD,
                             grad_scaler=torch.amp.GradScaler("cpu"), lr=0.1)
