"""parallelize(model, ep=) on transformers MoE families, by their own base_model_ep_plan: each
rank holds E/ep whole experts and its own slice of the batch; the mean loss, the load-balancing
loss (output_router_logits=True), the reduced gradients and one optimizer step equal the
unwrapped model's on the whole batch (torchpp.testing.expert_checks, float64)."""
import pytest

from torchpp.testing.expert_checks import check_ep, check_ep_pp

TIMEOUT_S = 240


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_ep2_equals_unwrapped(ranks, model_type):
    results = ranks(2).run(check_ep, model_type, ep=2, timeout=TIMEOUT_S)
    assert all("experts" in r for r in results), results


@pytest.mark.parametrize("model_type", ["mixtral"])
def test_ep2_tp2_equals_unwrapped(ranks, model_type):
    results = ranks(4).run(check_ep, model_type, ep=2, tp=2, timeout=TIMEOUT_S)
    assert all("experts" in r for r in results), results


def test_ep2_pp2_zero_bubble_equals_unwrapped(ranks):
    results = ranks(4).run(check_ep_pp, "qwen3_moe", ep=2, pp=2, schedule="zb-h1", timeout=TIMEOUT_S)
    assert all("grads" in r for r in results), results
