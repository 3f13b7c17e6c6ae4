"""Optimizer post-validation (DistributedOptimizer(post_validate=True)) gives exactly the
synchronous trajectory: a GPT trained with ZB-H2 over dp2 x pp2 (DP all-reduce, ZeRO-1, ZeRO-2) and
pp2 x tp2, where some steps clip and some do not. Each batch's accepted loss and the final
parameters equal the synchronous run's; the steps that needed clipping were rolled back,
redone clipped and their next batch run again (the last one by flush()). With an fp16 loss
scaler the inf/NaN check is post-validated too: an inf planted on one rank's gradient makes
every rank undo that update (the synchronous run skips it), back the scale off and run the
next batch again, and each accepted batch ran under the synchronous run's scale."""
from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from pipeline_checks import TOLERANCES, record_mismatch

BATCH, M, STEPS, LR = 8, 4, 6, 1e-2
# Between the gradient norms of this run's steps, so that some clip and some do not (asserted).
MAX_NORM = 0.64
TOL = TOLERANCES[torch.float32]
INF_STEP = 2  # scaled runs: an inf is planted in global rank 0's gradients of this batch
SCALER = dict(init_scale=2.0**8, growth_interval=2)  # grows within the run, so its speculation is tested


def _data(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, 32, (BATCH, 8), generator=g), torch.randint(0, 32, (BATCH, 8), generator=g)


def _train(state, schedule, zero, post_validate, scaled, checkpoint=None):
    """STEPS batches; returns each batch's accepted loss (last stage) and the loss scale it ran
    under, the global norms, the updates redone and undone, whether flushing kept the
    gradients, and this rank's final parameters."""
    from torchpp.models.gpt import GPT, GPTConfig, gpt_loss
    from torchpp.parallel import DistributedOptimizer, GradScaler, finalize_grads
    from torchpp.pipeline import PipelineStage, build_schedule, split_model

    torch.manual_seed(11)
    config = GPTConfig(vocab_size=32, hidden_size=16, num_heads=4, num_layers=4, max_seq_len=8, split_bw=True)
    model = GPT(config, group=state.tp_group)
    part = split_model(model, state.pp)[state.pp_rank]
    stage = PipelineStage(part, state.pp_rank, state.pp, torch.device("cpu"), group=state.pp_group,
                          tp_group=state.tp_group)
    loss_fn = lambda logits, labels: gpt_loss(logits, labels, state.tp_group)  # noqa: E731
    scaler = GradScaler("cpu", **SCALER) if scaled else None
    pipeline = build_schedule(schedule, stage, M, loss_fn=loss_fn, grad_scaler=scaler)
    optimizer = DistributedOptimizer(list(part.parameters()), torch.optim.AdamW, state, zero=zero,
                                     max_norm=MAX_NORM, accumulations_per_step=M, bucket_bytes=2048,
                                     grad_scaler=scaler, post_validate=post_validate, lr=LR)
    rows = slice(state.dp_rank * BATCH // state.dp, (state.dp_rank + 1) * BATCH // state.dp)
    losses, scales, norms, reruns, undone = [], [], [], 0, 0
    for step in range(STEPS):
        tokens, labels = _data(step)
        while True:
            optimizer.zero_grad()
            step_losses = []
            scale = scaler.get_scale() if scaled else 1.0
            pipeline.step(tokens[rows], target=labels[rows], losses=step_losses)
            finalize_grads([part], state)
            if scaled and step == INF_STEP and dist.get_rank() == 0:  # one rank's gradient only
                next(part.parameters()).grad.view(-1)[0] = float("inf")
            norm = optimizer.step()
            if not optimizer.rerun:
                break
            reruns += 1
            undone += optimizer.last_step_skipped
        scales.append(scale)
        if norm is not None:
            norms.append(norm.item())
        if step_losses:
            loss = torch.stack(step_losses).mean()
            dist.all_reduce(loss, group=state.dp_group)
            losses.append(loss / state.dp)
    grads_kept = True
    if post_validate:
        # The last update is settled by flush(), or by saving a checkpoint, between zero_grad
        # and the next backward: the gradients stay as they were.
        optimizer.zero_grad()
        updated = [p for g in optimizer.torch_optimizer.param_groups for p in g["params"]]
        before = [None if p.grad is None else p.grad.clone() for p in updated]
        if checkpoint:
            from torchpp.checkpoint import save_checkpoint, stage_parameters

            save_checkpoint(checkpoint, STEPS, stage_parameters(part, full_model=model), optimizer)
        else:
            optimizer.flush()
        grads_kept = all((a is None and p.grad is None) or (a is not None and torch.equal(a, p.grad))
                         for a, p in zip(before, updated))
        norms.append(optimizer.last_grad_norm.item())
        # Every redo or undo but the last made a re-run.
        assert optimizer.redone_steps + undone == reruns + (norms[-1] > MAX_NORM), (optimizer.redone_steps, undone)
    if scaled:
        scales.append(scaler.get_scale())  # the final one (post_validate: settled by the flush)
    return {"losses": losses, "scales": scales, "norms": norms, "grads_kept": grads_kept,
            "redone": optimizer.redone_steps if post_validate else 0, "undone": undone,
            "params": [p.detach().clone() for p in part.parameters()]}


def _check(dp, pp, tp, schedule, zero, scaled, checkpoint):
    from torchpp.parallel import init_parallel

    state = init_parallel(tp=tp, pp=pp, dp=dp)
    sync = _train(state, schedule, zero, False, scaled)
    speculative = _train(state, schedule, zero, True, scaled, checkpoint)
    mismatches = []
    for what in ["losses", "params"]:
        for k, (a, b) in enumerate(zip(speculative[what], sync[what])):
            record_mismatch(mismatches, a, b, f"{what}[{k}]", **TOL)
    norms = sync["norms"]
    skipped = [not math.isfinite(n) for n in norms]
    clipped = sum(n > MAX_NORM for n, skip in zip(norms, skipped) if not skip)
    return {"mismatches": mismatches, "norms": norms, "speculative_norms": speculative["norms"], "clipped": clipped,
            "skipped": sum(skipped), "redone": speculative["redone"], "undone": speculative["undone"],
            "grads_kept": speculative["grads_kept"], "scales": (speculative["scales"], sync["scales"])}


@pytest.mark.parametrize("dp,pp,tp,zero,scaled", [
    (2, 2, 1, False, False),
    (2, 2, 1, True, False),
    (2, 2, 1, 2, False),
    (1, 2, 2, False, False),
    (2, 2, 1, True, True),
    (1, 2, 2, False, True),
], ids=["dp2-pp2", "dp2-pp2-zero1", "dp2-pp2-zero2", "pp2-tp2", "dp2-pp2-zero1-loss-scaled", "pp2-tp2-loss-scaled"])
def test_post_validation_equals_synchronous_clipping(ranks, tmp_path, dp, pp, tp, zero, scaled):
    checkpoint = str(tmp_path / "ckpt") if zero else None  # ZeRO's last update is settled by save_checkpoint
    results = ranks(dp * pp * tp).run(_check, dp, pp, tp, "zb-h2", zero, scaled, checkpoint, timeout=300)
    for rank, result in enumerate(results):
        assert result["mismatches"] == [], f"rank {rank}"
        # The run exercises both outcomes, and every clipped step was redone (once).
        assert 0 < result["clipped"] < STEPS, (rank, result["norms"])
        assert result["redone"] == result["clipped"], (rank, result)
        assert result["grads_kept"], rank
        # Scaled: the planted inf made every rank's synchronous run skip that step, and the
        # post-validated run undo it; each batch ran under the same scale in both.
        assert result["skipped"] == result["undone"] == (1 if scaled else 0), (rank, result)
        speculative_scales, sync_scales = result["scales"]
        assert speculative_scales == sync_scales, (rank, result["scales"])
        if scaled:
            changes = [b / a for a, b in zip(sync_scales, sync_scales[1:])]
            assert 2.0 in changes and 0.5 in changes, sync_scales  # it grew and it backed off
        torch.testing.assert_close(result["speculative_norms"], result["norms"], equal_nan=True)


def test_post_validation_needs_max_norm():
    from torchpp.parallel import DistributedOptimizer

    params = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match="needs max_norm"):
        DistributedOptimizer(params, torch.optim.SGD, post_validate=True, lr=0.1)
