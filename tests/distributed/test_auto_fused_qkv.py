"""plan="auto" splits the fused query/key/value projection of multi-query attention
(torchpp.models.auto_fused_qkv, torchpp.tensor_parallel.fused_qkv): StarCoder's ``c_attn``
[q | k | v] and Falcon's ``query_key_value`` (H query heads then one k and one v head; grouped per
key/value head under Falcon's new architecture) split head by head, the key/value head copied on
both ranks. On gloo ranks in float64 against the unwrapped model (torchpp.testing.model_checks:
loss, logits, every gradient, one SGD step), every linear of each layer split, also at pp=2 x
tp=2; the gradient norm counts the copied rows once (also over ZeRO's flat segments);
save_hf_checkpoint and load_hf_weights round-trip them; two key/value heads over tp=4, each copied
on its own two ranks. Query heads the TP size does not divide keep the attention whole."""
import copy
import logging

import pytest
import torch

import torchpp
from torchpp.models import load_hf_weights, parallelize, save_hf_checkpoint
from torchpp.models.auto_plan import auto_plans
from torchpp.parallel import DistributedOptimizer, clip_grad_norm_
from torchpp.testing.model_checks import (SPLIT_NOTE, assert_close, batch, check_pp, check_tp, exact_causal_lm_loss,
                                          precision)
from torchpp.testing.tiny_models import tiny_model

TIMEOUT_S = 240
# (model type, config attributes, linears split per layer)
MULTI_QUERY = [("gpt_bigcode", {"multi_query": True}, "GPTBigCodeBlock 4/4"),
               ("falcon", {"multi_query": True, "new_decoder_architecture": False}, "FalconDecoderLayer 4/4"),
               ("falcon", {"new_decoder_architecture": True, "num_kv_heads": 1}, "FalconDecoderLayer 4/4"),
               ("gpt_bigcode", {"multi_query": False}, "GPTBigCodeBlock 4/4")]  # equal parts, as before


def _reference_norm(model, ids, labels):
    """The unwrapped model's gradient norm (a copy of ``model``; loss in float64)."""
    reference = copy.deepcopy(model)
    reference.loss_function = exact_causal_lm_loss
    reference(input_ids=ids, labels=labels, use_cache=False).loss.backward()
    return torch.nn.utils.clip_grad_norm_(reference.parameters(), float("inf"))


def _norm_with_copies():
    """tp=2: clip_grad_norm_ over the wrapped model's gradients equals the unwrapped model's norm."""
    with precision(torch.float64):
        state = torchpp.init_parallel(tp=2, pp=1)
        model = tiny_model("gpt_bigcode", multi_query=True)
        ids, labels = batch(model.config.vocab_size)
        expected = _reference_norm(model, ids, labels)
        model.loss_function = exact_causal_lm_loss
        wrapped = parallelize(model, state=state, plan="auto")
        wrapped(input_ids=ids, labels=labels, use_cache=False).loss.backward()
        assert any(hasattr(p, "tp_uncounted") for p in wrapped.parameters()) == (state.tp_rank == 1)
        norm = clip_grad_norm_(wrapped.parameters(), float("inf"), state=state)
        assert_close(norm, expected.to(norm.dtype), "gradient norm with copied key/value rows")
        return norm.item()


def _checkpoint_round_trip(directory):
    """save_hf_checkpoint writes the unsplit tensors (one copy of the key/value rows), bit for bit;
    load_hf_weights cuts each rank's shard, copies included, back out of them."""
    state = torchpp.init_parallel(tp=2, pp=1)
    model = tiny_model("gpt_bigcode", multi_query=True)  # biases too
    original = copy.deepcopy(model)
    wrapped = parallelize(model, state=state, plan="auto")
    save_hf_checkpoint(wrapped, directory)
    reloaded = type(original).from_pretrained(directory, dtype=torch.float64).state_dict()
    for name, value in original.state_dict().items():
        assert torch.equal(reloaded[name], value), f"saved {name}"
    other = parallelize(tiny_model("gpt_bigcode", multi_query=True, seed=7), state=state, plan="auto")
    load_hf_weights(other, directory)
    want = dict(wrapped.named_parameters())
    for name, param in other.named_parameters():
        assert torch.equal(param, want[name]), f"loaded {name}"


def _check_all(cases, directory):
    splits = [check_tp(model_type, plan="auto", **extra).partition(SPLIT_NOTE)[2] for model_type, extra, _ in cases]
    _checkpoint_round_trip(directory)
    return splits, _norm_with_copies()


def test_multi_query_attention_splits_with_key_value_heads_copied(ranks, tmp_path):
    results = ranks(2).run(_check_all, MULTI_QUERY, str(tmp_path / "saved"), timeout=TIMEOUT_S)
    for splits, _ in results:
        assert splits == [split for _, _, split in MULTI_QUERY], splits
    assert results[0][1] == results[1][1]  # the gradient norm, counting the copied rows once


def _zero_norm_with_copies():
    """dp=2 x tp=2 under ZeRO-2 with one-parameter buckets: each fused q/k/v weight is cut between the
    dp ranks (its copied rows in the second half), and the optimizer's gradient norm over the ranks'
    segments equals the unwrapped model's on the whole batch."""
    with precision(torch.float64):
        state = torchpp.init_parallel(tp=2, pp=1, dp=2)
        model = tiny_model("gpt_bigcode", multi_query=True)
        ids = labels = batch(model.config.vocab_size)[0]  # every position counted: the halves' means average to the whole's
        expected = _reference_norm(model, ids, labels)
        wrapped = parallelize(model, schedule="1f1b", n_microbatches=1, state=state, plan="auto")
        optimizer = DistributedOptimizer(wrapped.parameters(), torch.optim.SGD, state, zero=2, max_norm=1e9,
                                         bucket_bytes=4096, lr=0.0)
        rows, targets = (t.chunk(state.dp)[state.dp_rank] for t in (ids, labels))
        optimizer.zero_grad()
        wrapped.step(rows, labels=targets)
        norm = optimizer.step()
        assert_close(norm, expected.to(norm.dtype), "ZeRO-2 gradient norm with copied key/value rows")
        return norm.item()


def _pipelined():
    return check_pp("gpt_bigcode", pp=2, tp=2, plan="auto"), _zero_norm_with_copies()


def test_multi_query_attention_split_in_a_pipeline_and_under_zero(ranks):
    results = ranks(4).run(_pipelined, timeout=TIMEOUT_S)
    assert all("grads on this rank" in pipelined for pipelined, _ in results), results
    assert len({norm for _, norm in results}) == 1, results


def _two_heads_copied():
    return check_tp("falcon", tp=4, plan="auto", new_decoder_architecture=True, num_kv_heads=2)


def test_several_key_value_heads_each_copied_on_its_own_ranks(ranks):
    # 2 key/value heads over tp=4: ranks 0-1 hold a copy of head 0, ranks 2-3 of head 1. Each head's
    # gradient is summed over its own copies only (its slot of the all-reduced row), its input-gradient
    # share passed on once (once summed over all four ranks, the embedding's gradient was 10% off).
    details = ranks(4).run(_two_heads_copied, timeout=TIMEOUT_S)
    assert all(d.endswith("FalconDecoderLayer 4/4") for d in details), details


@pytest.mark.parametrize("model_type", ["gpt_bigcode", "falcon"])
def test_query_heads_tp_does_not_divide_keep_attention_whole(model_type, caplog):
    # 2 query heads over tp=4 (tried in this process): the MLP splits, the attention stays whole, the log says why.
    with caplog.at_level(logging.INFO, logger="torchpp"):
        plan, _ = auto_plans(tiny_model(model_type, num_attention_heads=2), tp=4)
    assert not any("attn" in name or "attention" in name for name in plan), plan
    assert len(plan) == 2, plan
    assert "kept whole (with its readers" in caplog.text and "split over tp=4 it fails" in caplog.text, caplog.text
