"""GPT-OSS split over TP: transformers' plan (5.24) splits its embedding alone, torchpp's amendment
(torchpp.models.plans.AMENDMENTS) its heads with their attention sinks and every expert's features,
biases included: gate and up alternate feature by feature, so each rank takes whole (gate, up) pairs,
and the down bias, added per expert before the routing weight and the sum over TP, is added as
bias / tp on each rank (``partial_sum_bias``). plan="auto" finds the same split by trial. On gloo
ranks in float64 against the unwrapped model (torchpp.testing.model_checks: loss, logits, every
gradient, one SGD step): tp=2 with and without sequence parallelism, pp=2 x tp=2 and ep=2 x tp=2
(experts whole per EP rank, or split over TP too). Adding the down bias whole on every rank instead
gives a wrong loss, which the check catches."""
import pytest

from torchpp.models.plans import AMENDMENTS
from torchpp.testing.expert_checks import check_ep
from torchpp.testing.model_checks import check_pp, check_tp

TIMEOUT_S = 300
EXPERTS = "model.layers.*.mlp.experts"


def _tensor_parallel():
    return [check_tp("gpt_oss"), check_tp("gpt_oss", sequence_parallel=True), check_tp("gpt_oss", plan="auto")]


def test_gpt_oss_splits_heads_and_experts(ranks):
    for own, own_sp, auto in ranks(2).run(_tensor_parallel, timeout=TIMEOUT_S):
        # 4 layers x (q, k, v weights and biases, o weight, sinks, 4 experts tensors less the down bias) + 2
        assert own.endswith("46 sharded") and own_sp.endswith("46 sharded"), (own, own_sp)
        assert auto.endswith("GptOssDecoderLayer 5/5"), auto  # its experts counted among the split


def _pipelined():
    return [check_pp("gpt_oss", pp=2, tp=2, schedule=schedule) for schedule in ("zb-h1", "interleaved-1f1b")]


def test_gpt_oss_in_a_pipeline(ranks):
    for done in ranks(4).run(_pipelined, timeout=TIMEOUT_S):
        assert all("grads on this rank" in d for d in done), done


def _expert_parallel():
    return [check_ep("gpt_oss", ep=2, tp=2), check_ep("gpt_oss", ep=2, tp=2, expert_tensor_parallel=True)]


def test_gpt_oss_under_expert_parallelism(ranks):
    # Each EP rank's 2 of 4 experts: whole, or their features split over TP (the down bias whole).
    for whole, split in ranks(4).run(_expert_parallel, timeout=TIMEOUT_S):
        assert whole.endswith("experts {(2, 64, 192), (2, 96, 64), (2, 192), (2, 64)}"), whole
        assert split.endswith("experts {(2, 64, 96), (2, 96), (2, 48, 64), (2, 64)}"), split


def _down_bias_added_on_every_rank():
    plan = {**AMENDMENTS["gpt_oss"], f"{EXPERTS}.down_proj_bias": "local_params"}
    with pytest.raises(AssertionError, match="loss"):
        check_tp("gpt_oss", plan=plan)
    return "refused"


def test_a_down_bias_added_whole_on_every_rank_is_caught(ranks):
    assert ranks(2).run(_down_bias_added_on_every_rank, timeout=TIMEOUT_S) == ["refused"] * 2
