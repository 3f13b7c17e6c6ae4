"""parallelize(model, ep=) on transformers MoE families, by their own base_model_ep_plan: each
rank holds E/ep whole experts and its own slice of the batch; the mean loss, the load-balancing
loss (output_router_logits=True), the reduced gradients and one optimizer step equal the
unwrapped model's on the whole batch (torchpp.testing.expert_checks, float64). Shared experts
(Qwen2-MoE, DeepSeek-V3) stay replicated; DeepSeek-V3's causal LM has no aux loss. Under a
pipeline the aux loss is per microbatch: equal to the unwrapped model with gradient accumulation
over the global microbatches (check_pp_aux_loss)."""
import pytest

from torchpp.testing.expert_checks import check_ep, check_ep_pp, check_pp_aux_loss

TIMEOUT_S = 240


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe", "qwen2_moe", "deepseek_v3"])
def test_ep2_equals_unwrapped(ranks, model_type):
    results = ranks(2).run(check_ep, model_type, ep=2, timeout=TIMEOUT_S)
    assert all("experts {(2," in r for r in results), results  # 4 experts, 2 per rank


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_every_token_to_one_ranks_experts(ranks, model_type):
    # Routers send every token to experts 0 and 1 (rank 0's): rank 1's experts get no rows and
    # no gradient, which must still reduce, clip and step as the unwrapped model's zeros.
    results = ranks(2).run(check_ep, model_type, ep=2, route_to=[0, 1], max_norm=0.5, timeout=TIMEOUT_S)
    assert all("experts {(2," in r for r in results), results


def test_data_parallel_aux_loss_is_the_whole_batchs(ranks):
    # ep=1, dp=2: no expert split, but the load-balancing loss still spans both ranks' rows.
    results = ranks(2).run(check_ep, "mixtral", ep=1, timeout=TIMEOUT_S)
    assert all("experts set()" in r for r in results), results


def check_ep_errors():
    import pytest
    import torchpp
    from torchpp.models import parallelize
    from torchpp.tensor_parallel.styles import PlanError
    from torchpp.testing.tiny_models import tiny_model

    import torch

    state = torchpp.init_parallel(ep=2)
    # The aux loss over both ranks' rows: a mask without padding is dropped, padding is refused.
    moe = parallelize(tiny_model("mixtral", output_router_logits=True), state=state, ep=2)
    ids = torch.zeros(2, 8, dtype=torch.long)
    assert moe(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).aux_loss is not None
    with pytest.raises(NotImplementedError, match="weight them by this rank's padding mask alone"):
        moe(input_ids=ids, attention_mask=torch.tensor([[1] * 8, [0] * 2 + [1] * 6]), use_cache=False)
    with pytest.raises(PlanError, match="has no base_model_ep_plan"):
        parallelize(tiny_model("llama"), state=state, ep=2)
    with pytest.raises(PlanError, match="holds 3 experts, which ep=2 does not divide"):
        parallelize(tiny_model("mixtral", num_local_experts=3), state=state, ep=2)
    state = torchpp.init_parallel(pp=2)
    with pytest.raises(ValueError, match=r"ep=2 disagree with the parallel state \(tp=1, pp=2, cp=1, ep=1\)"):
        parallelize(tiny_model("mixtral"), state=state, ep=2)
    with pytest.raises(ValueError, match=r"capacity_factor=1.5 applies to expert parallelism; .* has ep=1"):
        parallelize(tiny_model("mixtral"), state=state, capacity_factor=1.5)
    return True


def test_ep_errors_name_values(ranks):
    assert ranks(2).run(check_ep_errors) == [True, True]


def check_capacity(capacity_factor):
    import torch

    import torchpp
    from torchpp.models import parallelize
    from torchpp.testing.expert_checks import full_batch
    from torchpp.testing.tiny_models import tiny_model

    state = torchpp.init_parallel(ep=2)
    model = tiny_model("mixtral")
    reference = tiny_model("mixtral")
    ids, labels = full_batch(model.config.vocab_size)
    mine = slice(2 * state.dp_rank, 2 * state.dp_rank + 2)
    wrapped = parallelize(model, state=state, ep=2, capacity_factor=capacity_factor)
    loss = wrapped(input_ids=ids[mine], labels=labels[mine], use_cache=False).loss
    expected = reference(input_ids=ids[mine], labels=labels[mine], use_cache=False).loss
    return dict(wrapped.ep_dropped), bool(torch.allclose(loss, expected, rtol=1e-9, atol=0))


def test_capacity_factor_reports_dropped_pairs(ranks):
    # 32 tokens x 2 slots over 4 experts per rank: capacity 4 (factor 0.25) must drop; factor 4
    # (capacity 64) never does, and the loss is then the unwrapped model's.
    for dropped, same in ranks(2).run(check_capacity, 0.25, timeout=TIMEOUT_S):
        assert len(dropped) == 4 and all(n > 0 for n in dropped.values()) and not same, dropped
    for dropped, same in ranks(2).run(check_capacity, 4.0, timeout=TIMEOUT_S):
        assert len(dropped) == 4 and all(n == 0 for n in dropped.values()) and same, dropped


# 4 ranks (after the 2-rank tests: the harness keeps one pool alive at a time).
@pytest.mark.parametrize("model_type, expert_tensor_parallel", [("mixtral", False), ("mixtral", True),
                                                                  ("qwen3_moe", False), ("qwen3_moe", True)])
def test_ep2_tp2_equals_unwrapped(ranks, model_type, expert_tensor_parallel):
    results = ranks(4).run(check_ep, model_type, ep=2, tp=2, expert_tensor_parallel=expert_tensor_parallel,
                           timeout=TIMEOUT_S)
    assert all("grads" in r for r in results), results
    if model_type == "mixtral":  # whole experts [2, 2I, h] per rank, or (ETP) each split over TP too
        assert all(("(2, 96, 64)" in r) == expert_tensor_parallel for r in results), results


@pytest.mark.parametrize("options", [dict(ep=2), dict(ep=2, zero=True), dict(ep=2, tp=2, zero=True), dict(ep=4)],
                         ids=["dp4-ep2", "dp4-ep2-zero1", "tp2-dp2-ep2-zero1", "dp4-ep4"])
def test_ep_optimizer_reduces_clips_and_shards_expert_state(ranks, options):
    # dp=4, ep=2: each expert is held by 2 ranks (expert_dp_group), which alone reduce (or, under
    # ZeRO-1, shard) its gradients; clipping at 0.5 needs the global norm with each expert once.
    # ep=4: one expert per rank.
    results = ranks(4).run(check_ep, "mixtral", max_norm=0.5, timeout=TIMEOUT_S, **options)
    per_rank = 4 // options["ep"]
    assert all(f"experts {{({per_rank}," in r for r in results), results


@pytest.mark.parametrize("model_type, schedule, n_microbatches", [("qwen3_moe", "zb-h1", 2), ("mixtral", "zb-h1", 2),
                                                                  ("qwen3_moe", "dualpipe", 4),
                                                                  ("mixtral", "dualpipe", 4),
                                                                  ("mixtral", "dualpipe-v", 4)])
def test_ep2_pp2_equals_unwrapped(ranks, model_type, schedule, n_microbatches):
    results = ranks(4).run(check_ep_pp, model_type, ep=2, pp=2, schedule=schedule, n_microbatches=n_microbatches,
                           timeout=TIMEOUT_S)
    assert all("grads" in r for r in results), results


@pytest.mark.parametrize("model_type, schedule, n_microbatches", [("mixtral", "zb-h1", 2), ("qwen3_moe", "zb-h1", 2),
                                                                  ("mixtral", "dualpipe", 4),
                                                                  ("qwen3_moe", "dualpipe", 4),
                                                                  ("mixtral", "dualpipe-v", 4),
                                                                  ("qwen3_moe", "interleaved-1f1b", 4)])
def test_aux_loss_under_pp_equals_gradient_accumulation(ranks, model_type, schedule, n_microbatches):
    # output_router_logits=True at ep=2 x pp=2 (dp=2): each microbatch's loss holds the aux loss of
    # that microbatch over both dp ranks' rows (the router statistics travel down the pipeline);
    # equal to transformers over the global microbatches with gradient accumulation.
    results = ranks(4).run(check_pp_aux_loss, model_type, ep=2, pp=2, schedule=schedule,
                           n_microbatches=n_microbatches, timeout=TIMEOUT_S)
    # DualPipe: both end ranks hold a last stage (DualPipe-V: rank 0 alone; interleaved: rank 1, with
    # two stages a rank, the statistics handed between them locally).
    assert sum("aux " in r for r in results) == (4 if schedule == "dualpipe" else 2), results
    # DualPipe's forward-backward overlap (the default there): the loss's dp collectives run in
    # both threads, the backward's on the twin groups.
    assert all(r.endswith("overlap on") == schedule.startswith("dualpipe") for r in results), results


@pytest.mark.parametrize("options", [dict(schedule="1f1b", recompute="full", padded=True), dict(schedule="zb-h1", tp=2)],
                         ids=["dp2-padded-recompute", "tp2"])
def test_aux_loss_under_pp_without_ep(ranks, options):
    # ep=1, pp=2: the carried statistics do not depend on expert parallelism. dp=2 with padding
    # (transformers' masked counts) and recompute="full": each layer's routers re-run in backward,
    # without the mask, and must save what their forward saved. tp=2 (dp=1): the statistics
    # travel split over TP ranks (scatter/gather P2P).
    results = ranks(4).run(check_pp_aux_loss, "mixtral", ep=1, pp=2, n_microbatches=2, timeout=TIMEOUT_S, **options)
    assert sum("aux " in r for r in results) == 2, results


def check_aux_loss_under_pp_refusals():
    import pytest
    import torch
    import torchpp
    from torchpp.models import parallelize
    from torchpp.testing.tiny_models import tiny_model

    state = torchpp.init_parallel(pp=2, tp=2)  # a sequence-parallel router would count its slice alone
    with pytest.raises(NotImplementedError, match=r"\(pp=2\) is not supported with sequence_parallel=True and tp=2"):
        parallelize(tiny_model("mixtral", output_router_logits=True), state=state, sequence_parallel=True)
    state = torchpp.init_parallel(pp=2)  # dp=2
    model = parallelize(tiny_model("mixtral", output_router_logits=True), state=state, schedule="1f1b",
                        n_microbatches=2)
    ids = torch.zeros(2, 8, dtype=torch.long)
    first, last = (ids if model.has_first_stage else None), (ids if model.has_last_stage else None)
    # A mask without padding gives the unmasked statistics: the same loss and aux loss.
    plain = model.eval_step(first, last)
    plain_aux = model.aux_loss
    masked = model.eval_step(first, last, attention_mask=torch.ones_like(ids) if model.has_first_stage else None)
    if model.has_last_stage:
        assert torch.equal(plain, masked) and torch.equal(plain_aux, model.aux_loss) and plain_aux > 0
    else:
        assert plain is None and model.aux_loss is None
    square = torch.ones(2, 1, 8, 8)  # transformers' loss reads a [batch, seq] mask
    with pytest.raises(Exception, match=r"by a 2D \[batch, seq\] attention_mask, .* shape \[1, 1, 8, 8\]"):
        model.eval_step(first, last, attention_mask=square if model.has_first_stage else None)
    return True


def test_aux_loss_under_pp_refuses_what_it_cannot_count(ranks):
    assert ranks(4).run(check_aux_loss_under_pp_refusals) == [True] * 4
