"""Per-head inputs of head-split attention (torchpp.tensor_parallel.head_inputs), single-process:
plan="auto" finds the ALiBi bias BLOOM, MPT and Falcon build outside their attention and cuts it
to each rank's heads (a learned one too: its cut gathers its gradient); where the cut is not
proven right by the one-layer split trial (auto_check), the attention stays whole and the log says why. The
distributed equivalence is in tests/distributed/test_auto_head_inputs.py."""
import logging

import pytest
import torch
from torch import nn

from torchpp.models.auto_plan import auto_plans
from torchpp.tensor_parallel.head_inputs import own_heads, slice_head_inputs
from torchpp.tensor_parallel.styles import PlanError, get_style
from torchpp.testing.tiny_models import tiny_model

FALCON_ALIBI = dict(multi_query=False, new_decoder_architecture=False, alibi=True, num_kv_heads=4)


@pytest.mark.parametrize("model_type, extra, attention, inputs", [
    ("bloom", {}, "transformer.h.*.self_attention", "alibi"),  # [batch*heads, 1, keys]
    ("mpt", {}, "transformer.blocks.*.attn", "position_bias"),  # [heads, 1, keys]
    ("falcon", FALCON_ALIBI, "transformer.h.*.self_attention", "alibi,attention_mask"),  # [batch, heads, q, k]
])
def test_auto_plan_cuts_alibi_to_each_ranks_heads(model_type, extra, attention, inputs):
    plan, _ = auto_plans(tiny_model(model_type, **extra), tp=2)
    assert plan[attention] == f"split_head_inputs({inputs})"
    assert plan[f"{attention}.{'Wqkv' if model_type == 'mpt' else 'query_key_value'}"] in ("colwise", "packed3_colwise")
    assert plan[f"{attention}.{'out_proj' if model_type == 'mpt' else 'dense'}"] == "rowwise"


def _mix_heads(monkeypatch, modeling):
    """Each head's bias also reads the previous head's: a cut to each rank's heads changes it."""
    forward = modeling.BloomAttention.forward

    def mixed(self, *args, alibi, **kwargs):
        return forward(self, *args, alibi=alibi + alibi.roll(1, dims=0), **kwargs)
    monkeypatch.setattr(modeling.BloomAttention, "forward", mixed)


def _learn_slopes(monkeypatch, modeling):
    """A learned bias: cut by an op whose backward gathers the heads' gradients."""
    slopes, scale = modeling._get_alibi_slopes, nn.Parameter(torch.ones((), dtype=torch.float64))
    monkeypatch.setattr(modeling, "_get_alibi_slopes", lambda *args: slopes(*args) * scale)


def test_a_learned_bias_is_cut_too(monkeypatch):
    from transformers.models.bloom import modeling_bloom

    _learn_slopes(monkeypatch, modeling_bloom)
    plan, _ = auto_plans(tiny_model("bloom"), tp=2)
    assert plan["transformer.h.*.self_attention"] == "split_head_inputs(alibi)", plan


@pytest.mark.parametrize("patch, cut_tried", [(_mix_heads, True)])
def test_attention_stays_whole_where_the_cut_is_not_proven(monkeypatch, caplog, patch, cut_tried):
    from transformers.models.bloom import modeling_bloom

    patch(monkeypatch, modeling_bloom)
    with caplog.at_level(logging.INFO, logger="torchpp"):
        plan, _ = auto_plans(tiny_model("bloom"), tp=2)
    assert not any("self_attention" in entry for entry in plan), plan
    kept = next(line for line in caplog.text.splitlines() if "self_attention.dense: kept whole" in line)
    assert "split over tp=2 it fails" in kept and ("with split_head_inputs(alibi) it fails too: split over tp=2, the "
                                                   "summed outputs" in kept) == cut_tried, kept
    assert "linears split per layer: BloomBlock 2/4" in caplog.text


def test_own_heads_takes_this_ranks_rows_batch_major():
    heads, batch = 4, 3
    bias = torch.arange(batch * heads, dtype=torch.float64).view(batch * heads, 1, 1).expand(-1, 1, 5)
    mine = own_heads(bias, heads, rank=1, size=2, batch=batch, what="alibi")
    assert mine[:, 0, 0].tolist() == [2, 3, 6, 7, 10, 11]
    per_batch = bias.reshape(batch, heads, 1, 5)
    assert torch.equal(own_heads(per_batch, heads, 1, 2, batch, "mask"), per_batch[:, 2:])
    broadcast = torch.zeros(batch, 1, 5, 5)  # the same for every head: unchanged
    assert own_heads(broadcast, heads, 1, 2, batch, "mask") is broadcast
    with pytest.raises(ValueError, match=r"alibi of shape \(10, 1, 5\) does not hold 4 heads"):
        own_heads(torch.zeros(10, 1, 5), heads, 0, 2, batch, "alibi")


def test_split_head_inputs_by_hand():
    style = get_style("split_head_inputs(alibi, mask)", "h.0.attn")
    assert style.names == ("alibi", "mask")
    with pytest.raises(PlanError, match="unknown style 'split_head_inputs'"):
        get_style("split_head_inputs", "h.0.attn")

    class Attention(nn.Module):
        def forward(self, hidden, bias):
            return hidden + bias.sum()

    with pytest.raises(PlanError, match="has no input named 'alibi'"):
        slice_head_inputs(Attention(), ("alibi",), 4, 0, 2, "h.0.attn")
    attention = Attention()
    slice_head_inputs(attention, ("bias",), 4, 1, 2, "h.0.attn")
    bias = torch.arange(4.0).view(4, 1, 1)
    assert attention(torch.zeros(1), bias).item() == 5.0  # heads 2 and 3, given by position
