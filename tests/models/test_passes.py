"""Each pass of parallelize alone (torchpp.models.passes): the config and its old keywords, the
refusals of plan resolution, the pipeline cut, recomputation, ZeRO marking, the run-order trace
and plan="auto"; TP/SP alone on two gloo ranks. Single-process unless they need a TP group."""
import copy
import types

import pytest
import torch

from torchpp.models.parallel_config import KEYWORDS, ParallelConfig, PipelineOptions
from torchpp.models.passes import (WrapState, apply_pipeline_cut, apply_plans, apply_recompute, apply_tp,
                                   apply_zero)
from torchpp.models.passes.pipeline_cut import layer_bounds, placement
from torchpp.models.plans import hf_layout
from torchpp.models.placeholders import Elsewhere, ElsewhereLayer
from torchpp.tensor_parallel.styles import PlanError
from torchpp.testing.tiny_models import tiny_model


def fake_state(**sizes):
    """A ParallelState stand-in: the passes tested here read only sizes and ranks."""
    base = dict(tp=1, pp=1, cp=1, ep=1, dp=1, tp_rank=0, pp_rank=0, tp_group=None, device=torch.device("cpu"))
    return types.SimpleNamespace(**{**base, **sizes})


def test_config_takes_every_old_keyword():
    values = {keyword: object() for keyword in KEYWORDS}
    values.update(recompute="full", zero=2, cp_mode="all-to-all+ring")  # (checked values; its group size any)
    config = ParallelConfig.from_keywords(**values)
    for keyword, (group, name) in KEYWORDS.items():
        holder = getattr(config, group) if group else config
        assert getattr(holder, name) is values[keyword] or keyword in ("recompute", "zero", "cp_mode"), keyword
    assert config.recompute == "full" and config.zero == 2 and config.context.mode == "all-to-all+ring"


def test_config_keywords_override_a_config_without_changing_it():
    base = ParallelConfig(pipeline=PipelineOptions(schedule="zb-h1", n_microbatches=8))
    derived = ParallelConfig.from_keywords(base, n_microbatches=4, zero=True)
    assert (derived.pipeline.schedule, derived.pipeline.n_microbatches, derived.zero) == ("zb-h1", 4, 1)
    assert base.pipeline.n_microbatches == 8 and base.zero == 0


def test_config_refuses_unknown_keywords_and_bad_values():
    with pytest.raises(TypeError, match="shedule"):
        ParallelConfig.from_keywords(shedule="zb-h1")
    with pytest.raises(ValueError, match="sometimes"):
        ParallelConfig(recompute="sometimes")
    with pytest.raises(TypeError, match="ParallelConfig"):
        ParallelConfig.from_keywords(2)


def test_plans_refuse_before_any_change():
    model = tiny_model("llama", causal_lm=False)
    before = copy.deepcopy(model.state_dict())
    for keywords, error in ((dict(vocab_parallel_logits=True), "causal LM"), (dict(plan="sometimes"), "dict"),
                            (dict(recompute="selective", plan={"layers.*.mlp.up_proj": "colwise"}), None)):
        state = WrapState(fake_state())
        try:
            apply_plans(model, state, ParallelConfig.from_keywords(**keywords))
        except (ValueError, PlanError) as caught:
            assert error is None or error in str(caught), caught
        assert type(model).__name__ == "LlamaModel"
        assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_pipeline_cut_keeps_this_ranks_stage():
    model = tiny_model("llama")
    state = WrapState(fake_state(pp=2, pp_rank=1), hf=True, layout=hf_layout(model))
    apply_pipeline_cut(model, state, PipelineOptions(schedule="zb-h1", n_microbatches=4))
    assert state.placement.mine == [1] and list(state.stages) == [1]
    assert [isinstance(layer, ElsewhereLayer) for layer in model.model.layers] == [True, True, False, False]
    assert isinstance(model.model.embed_tokens, Elsewhere) and not isinstance(model.lm_head, Elsewhere)


def test_placement_and_bounds():
    where = placement("interleaved-1f1b", pp=2, n_microbatches=4, pp_rank=0)
    assert (where.num_stages, where.mine, where.rank_of) == (4, [0, 2], {0: 0, 1: 1, 2: 0, 3: 1})
    assert layer_bounds(8, 4, None) == [0, 2, 4, 6, 8]
    with pytest.raises(ValueError, match="increasing"):
        layer_bounds(8, 2, [0])


def test_full_recompute_alone_keeps_gradients():
    model = tiny_model("llama")
    reference = copy.deepcopy(model)
    apply_recompute(model, WrapState(fake_state(), layout=hf_layout(model)), "full")
    assert all(layer.forward.func.__module__ == "torchpp.recompute" for layer in model.model.layers)
    ids = torch.randint(0, 97, (2, 8), generator=torch.Generator().manual_seed(0))
    for m in (model, reference):
        m(input_ids=ids, labels=ids).loss.backward()
    for (name, a), b in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-12, msg=name)


def test_zero_marking_alone():
    model = tiny_model("llama")
    apply_zero(model, WrapState(fake_state()), True)
    assert model.zero_stage == 1 and all(p.zero_stage == 1 for p in model.parameters())


def check_tp_pass_alone():
    """apply_plans + apply_tp on two ranks: the sharded model's loss equals the unwrapped one's."""
    import torchpp
    from torchpp.testing.model_checks import float64_throughout

    with float64_throughout():
        ps = torchpp.init_parallel(tp=2, pp=1)
        model = tiny_model("qwen3")
        reference = copy.deepcopy(model)
        state = WrapState(ps)
        config = ParallelConfig()
        apply_tp(apply_plans(model, state, config), state, config.tensor)
        sharded = [n for n, p in model.named_parameters() if getattr(p, "tensor_model_parallel", False)]
        ids = torch.randint(0, 97, (2, 8), generator=torch.Generator().manual_seed(0))
        got, want = model(input_ids=ids, labels=ids).loss, reference(input_ids=ids, labels=ids).loss
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    return len(sharded)


def test_tp_pass_alone(ranks):
    assert all(n > 0 for n in ranks(2).run(check_tp_pass_alone, timeout=120))
