"""plan="auto" splits experts held as raw 3-D parameters (torchpp.models.auto_experts) as
transformers' own MoE plans do: every expert's intermediate features over TP, gate and up half by
half, f on the tokens and routing weights, the partial outputs summed. On gloo ranks in float64
against the unwrapped model (torchpp.testing.model_checks: loss, logits, every gradient, one SGD
step): OLMoE's [E, 2I, H] experts, Llama 4's transposed [E, H, 2I], under sequence parallelism,
in a pp=2 x tp=2 pipeline and with expert parallelism (ep=2 x tp=2, the experts whole or split
over TP). Per-expert biases split with their weights (GPT-OSS); experts holding any other
parameter stay whole, and the log says why. A user plan naming experts' linears held in one 3-D weight (JetMoE's layout) splits them like
linears, one called with its input by keyword too."""
import logging

import torch

from torchpp.models.auto_plan import auto_plans
from torchpp.testing.expert_checks import check_ep
from torchpp.testing.model_checks import check_pp, check_tp
from torchpp.testing.tiny_models import tiny_model

TIMEOUT_S = 300


def _split_experts():
    return [check_tp("olmoe", plan="auto"), check_tp("llama4_text", plan="auto"),
            check_tp("olmoe", plan="auto", sequence_parallel=True)]


def test_experts_of_raw_weights_split(ranks):
    details = ranks(2).run(_split_experts, timeout=TIMEOUT_S)
    for olmoe, llama4, olmoe_sp in details:  # the experts module counts among the split (was 4/4, 7/8)
        assert olmoe.endswith("OlmoeDecoderLayer 5/5") and olmoe_sp.endswith("OlmoeDecoderLayer 5/5"), details
        assert llama4.endswith("Llama4TextDecoderLayer 8/9"), details  # its router stays whole


def _pipelined():
    return check_pp("olmoe", pp=2, tp=2, schedule="zb-h1", plan="auto")


def test_experts_split_in_a_pipeline(ranks):
    assert all("grads on this rank" in d for d in ranks(4).run(_pipelined, timeout=TIMEOUT_S))


def _with_expert_parallelism():
    return [check_ep("olmoe", ep=2, tp=2, plan="auto"),
            check_ep("olmoe", ep=2, tp=2, plan="auto", expert_tensor_parallel=True)]


def test_experts_under_expert_parallelism(ranks):
    # ep=2 x tp=2: each rank's 2 of 4 whole experts (the auto plan's TP entries for them dropped), or,
    # with expert_tensor_parallel, its 2 experts split over TP by the auto plan's entries.
    for plain, split in ranks(4).run(_with_expert_parallelism, timeout=TIMEOUT_S):
        assert plain.endswith("experts {(2, 64, 96), (2, 192, 64)}"), plain
        assert split.endswith("experts {(2, 96, 64), (2, 64, 48)}"), split


def test_experts_with_biases_split_with_them():
    # GPT-OSS's gate and up alternate feature by feature: the half-by-half split fails its trial, the
    # plain one holds (each rank's features whole pairs); the biases split with their weights.
    # (tests/distributed/test_gpt_oss.py runs the model so split on gloo ranks.)
    plan, _ = auto_plans(tiny_model("gpt_oss"), tp=2)
    experts = "model.layers.*.mlp.experts"
    assert {k: v for k, v in plan.items() if k.startswith(experts)} == {
        experts: "moe_tp_experts", f"{experts}.gate_up_proj": "rowwise", f"{experts}.down_proj": "colwise",
        f"{experts}.gate_up_proj_bias": "colwise", f"{experts}.down_proj_bias": "partial_sum_bias"}, plan


def test_experts_holding_other_parameters_stay_whole(caplog):
    model = tiny_model("gpt_oss")
    for layer in model.model.layers:
        layer.mlp.experts.register_parameter("scale", torch.nn.Parameter(torch.ones(1, dtype=torch.float64)))
    with caplog.at_level(logging.INFO, logger="torchpp"):
        plan, _ = auto_plans(model, tp=2)
    assert not any("experts" in name for name in plan), plan
    assert "mlp.experts: kept whole (holds scale besides its experts' weights and [experts, features] biases)" \
        in caplog.text, caplog.text


class _PerExpert(torch.nn.Module):
    """Experts' linears in one 3-D weight, each expert applied to its own rows (JetMoE's layout)."""

    def __init__(self, experts, out, width):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(experts, out, width, dtype=torch.float64))

    def forward(self, inputs, sizes):
        return torch.cat([rows @ self.weight[i].t() for i, rows in enumerate(inputs.split(sizes))])


class _Experts(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = _PerExpert(3, 8, 4), _PerExpert(3, 4, 8)

    def forward(self, x, sizes):
        return self.down(torch.relu(self.up(inputs=x, sizes=sizes)), sizes)  # up called by keyword


def _user_plan_on_expert_linears():
    import copy

    import torchpp
    from torchpp.models import parallelize

    state = torchpp.init_parallel(tp=2)
    try:
        torch.manual_seed(0)
        model, x, sizes = _Experts(), torch.randn(6, 4, dtype=torch.float64), [1, 3, 2]
        reference = copy.deepcopy(model)
        reference(x, sizes).square().sum().backward()
        wrapped = parallelize(model, plan={"tp": {"up": "colwise", "down": "rowwise"}}, state=state)
        x.requires_grad_(True)
        wrapped(x, sizes).square().sum().backward()
        x_ref = x.detach().clone().requires_grad_(True)
        copy.deepcopy(reference)(x_ref, sizes).square().sum().backward()
        rows = slice(4 * state.tp_rank, 4 * (state.tp_rank + 1))
        torch.testing.assert_close(wrapped.up.weight.grad, reference.up.weight.grad[:, rows], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(wrapped.down.weight.grad, reference.down.weight.grad[:, :, rows], rtol=1e-10,
                                   atol=1e-12)
        torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-10, atol=1e-12)  # the f summed the input's gradient
        return tuple(wrapped.up.weight.shape), tuple(wrapped.down.weight.shape)
    finally:
        torchpp.destroy_parallel()


def test_a_user_plan_splits_expert_linears(ranks):
    # A plan naming experts' linears (told by their forward) splits them like linears, an input
    # given by keyword included: each rank's 4 of up's 8 output features and down's 8 input
    # features, of every expert; the input's gradient summed over TP (f), the output's (g).
    assert ranks(2).run(_user_plan_on_expert_linears, timeout=TIMEOUT_S) == [((3, 4, 4), (3, 4, 4))] * 2
