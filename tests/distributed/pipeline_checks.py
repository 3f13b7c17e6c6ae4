"""Rank-side checks for the pipeline tests: train TinyLM with a schedule for a few optimizer
steps and compare losses and every local gradient with the same model run in one process."""
from __future__ import annotations

import traceback
from types import SimpleNamespace

import torch
import torch.distributed as dist

from pipeline_models import lm_loss, make_batches, make_model, stage_split_points
from torchpp import schedule as S
from torchpp.pipeline import PipelineStage, build_schedule, split_model
from torchpp.pipeline.microbatch import loss_weights, split_microbatches

TOLERANCES = {torch.float64: dict(rtol=1e-10, atol=1e-12), torch.float32: dict(rtol=1e-5, atol=1e-6)}


def local_last_microbatches(sched):
    """Indices of the microbatches whose loss this rank computes (its last stages)."""
    sch = sched.schedule
    spp = sch.num_stages // sch.num_pipelines
    m = sch.num_microbatches
    mine = []
    for stage, rank in enumerate(sch.stage_to_rank):
        if rank == sched.rank and stage % spp == spp - 1:
            k = stage // spp
            mine += range(k * m // sch.num_pipelines, (k + 1) * m // sch.num_pipelines)
    return sorted(mine)


def build_pipeline(name, dtype, m, pp_group, tp_group, scatter_gather, in_order_p2p, schedule_class=None,
                   **schedule_options):
    """TinyLM split into the schedule's stages on this rank, and the whole model in one process
    (same initialisation) as the reference. ``schedule_class``: one of torch's schedule classes
    (for ``name``'s schedule) instead of build_schedule; ``schedule_options``: more arguments."""
    p = dist.get_world_size(pp_group)
    pp_rank = dist.get_rank(pp_group)
    # A name of the compiler, or the path of a schedule in torch's CSV format (run as given).
    given = S.from_csv(name, num_ranks=p, num_microbatches=m) if name.endswith(".csv") else None
    probe = given if given is not None else S.generate(name, num_ranks=p, num_microbatches=m)
    model_stages = probe.num_stages // probe.num_pipelines
    model = make_model(model_stages, dtype, tp_group=tp_group)
    reference = make_model(model_stages, dtype)
    parts = split_model(model, model_stages, stage_split_points(model_stages, model_stages))
    mine = sorted({probe.model_stage(s) for s, r in enumerate(probe.stage_to_rank) if r == pp_rank})
    stages = [PipelineStage(parts[k], k, model_stages, "cpu", group=pp_group, tp_group=tp_group) for k in mine]
    if schedule_class is not None:
        sched = schedule_class(stages[0] if len(stages) == 1 else stages, m, lm_loss, scatter_gather=scatter_gather,
                               in_order_p2p=in_order_p2p, **schedule_options)
    else:
        sched = build_schedule(name if given is None else given, stages, m, loss_fn=lm_loss,
                               scatter_gather=scatter_gather, in_order_p2p=in_order_p2p, **schedule_options)
    params = [prm for st in stages for prm in st.submod.parameters()]
    return SimpleNamespace(probe=probe, model=model, reference=reference, sched=sched, params=params)


def train_and_compare(name, dtype=torch.float64, m=8, batch=16, seq_lens=(6, 6), pp_group=None, tp_group=None,
                      scatter_gather=True, in_order_p2p=None, lr=0.5):
    """Trains len(seq_lens) steps; asserts every local gradient equals the reference's.

    Returns per step this rank's share of the batch loss and the reference loss, plus the
    measured and simulated peak activations of the last step.
    """
    pp_rank = dist.get_rank(pp_group)
    tp_size = tp_group.size() if tp_group is not None else 1
    tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
    built = build_pipeline(name, dtype, m, pp_group, tp_group, scatter_gather, in_order_p2p)
    probe, model, reference, sched, params = built.probe, built.model, built.reference, built.sched, built.params
    names = {id(prm): n for n, prm in model.named_parameters()}
    ref_params = dict(reference.named_parameters())
    opt = torch.optim.SGD(params, lr=lr)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=lr)
    tol = TOLERANCES[dtype]
    steps = []
    for step, (x, y) in enumerate(make_batches(batch, seq_lens)):
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
        losses = []
        sched.step(x, target=y, losses=losses)
        ref_loss = lm_loss(reference(x), y)
        ref_loss.backward()
        weights = loss_weights(split_microbatches(y, m))
        share = sum(weights[k] * loss.item() for k, loss in zip(local_last_microbatches(sched), losses))
        for prm in params:
            ref = ref_params[names[id(prm)]].grad
            if getattr(prm, "tensor_model_parallel", False):
                ref = ref.chunk(tp_size, dim=prm.partition_dim)[tp_rank]
            torch.testing.assert_close(prm.grad, ref, **tol,
                                       msg=lambda s, n=names[id(prm)]: f"{name} step {step} grad of {n}: {s}")
        opt.step()
        ref_opt.step()
        steps.append({"loss_share": share, "ref_loss": ref_loss.item(), "has_loss": bool(losses)})
    simulated = S.simulate(probe).peak_activations[pp_rank]
    return {"steps": steps, "peak": sched.peak_activations, "simulated_peak": simulated,
            "timeline": [a for a, *_ in sched.timeline()]}


def eval_and_compare(name, dtype=torch.float64, m=8, batch=16, pp_group=None, in_order_p2p=None):
    """eval() before and after a training step, with and without target and at two sequence
    lengths: the outputs and losses of this rank's last stages equal the reference forward,
    and eval leaves every gradient as it was. Returns this rank's share of each eval's loss
    and the reference loss."""
    built = build_pipeline(name, dtype, m, pp_group, None, True, in_order_p2p)
    sched, reference, params = built.sched, built.reference, built.params
    tol = TOLERANCES[dtype]
    mine = local_last_microbatches(sched)
    shares = []
    (x, y), (x2, y2) = make_batches(batch, (6, 4))
    # Each executor (train, eval) re-exchanges shapes when its own last step's differ.
    plan = [("eval", x, y), ("step", x, y), ("eval", x2, None), ("step", x2, y2), ("eval", x, y)]
    for k, (kind, inputs, target) in enumerate(plan):
        grads_before = [None if prm.grad is None else prm.grad.clone() for prm in params]
        losses = []
        out = getattr(sched, kind)(inputs, target=target, losses=losses)
        if kind == "step":
            continue
        for prm, before in zip(params, grads_before):  # eval touches no gradient
            assert (prm.grad is None) == (before is None) and (before is None or torch.equal(prm.grad, before)), k
        with torch.no_grad():
            ref_out = reference(inputs)
        want = split_microbatches(ref_out, m)
        assert (out is None) == (not mine), (k, mine)
        if mine:
            torch.testing.assert_close(out, torch.cat([want[i] for i in mine]), **tol,
                                       msg=lambda s: f"{name} eval {k} outputs: {s}")
        if target is None:
            assert losses == [], k
            continue
        weights = loss_weights(split_microbatches(target, m))
        shares.append((sum(weights[i] * loss.item() for i, loss in zip(mine, losses)), lm_loss(ref_out, target).item()))
    assert sched.eval(x, target=y, return_outputs=False) is None
    return {"shares": shares}


def run_configs(configs, check=train_and_compare):
    """Runs each config on a fresh pipeline group (so a failure cannot poison the next);
    returns per config the result or the traceback."""
    results = []
    for config in configs:
        group = dist.new_group(list(range(dist.get_world_size())))
        try:
            results.append(check(pp_group=group, **config))
        except Exception:
            results.append({"error": traceback.format_exc()})
    return results


def record_mismatch(mismatches, actual, expected, what, **tolerances):
    """Appends ``what``'s assert_close failure to ``mismatches`` instead of raising: a rank that
    left its loop early would leave the others in their next step, waiting until the timeout."""
    try:
        torch.testing.assert_close(actual, expected, **tolerances)
    except AssertionError as error:
        mismatches.append(f"{what}: {error}")


def assert_no_rank_errors(per_rank):
    """Fails with every rank's traceback if any rank's result is an error."""
    errors = [f"rank {k}:\n{r['error']}" for k, r in enumerate(per_rank) if isinstance(r, dict) and "error" in r]
    assert not errors, "\n".join(errors)


def config_results(results, index):
    """Config ``index``'s result on every rank (``results``: per rank, run_configs' list),
    after asserting that no rank raised."""
    per_rank = [r[index] for r in results]
    assert_no_rank_errors(per_rank)
    return per_rank


def run_tp_pp(configs, check=train_and_compare):
    """TP=2 x PP=2 on 4 ranks: rank = pp * 2 + tp."""
    rank = dist.get_rank()
    results = []
    for config in configs:
        tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        pp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        try:
            results.append(check(pp_group=pp_groups[rank % 2], tp_group=tp_groups[rank // 2], **config))
        except Exception:
            results.append({"error": traceback.format_exc()})
    return results
