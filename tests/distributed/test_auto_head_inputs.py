"""plan="auto" on ALiBi models: the bias built outside the attention for every head (BLOOM's
[batch*heads, 1, keys], MPT's [heads, 1, keys], Falcon's [batch, heads, queries, keys] with
alibi=True) is cut to each rank's heads (torchpp.tensor_parallel.head_inputs), so the attention's
fused QKV and output projection split with the MLP (4 of 4 linears per layer); so is CPM-Ant's
learned relative position bias, whose cut gathers its gradient (7 of 7). On real gloo ranks
in float64 against the unwrapped model (torchpp.testing.model_checks: loss, logits, every
gradient, one SGD step), at tp=2 and, for BLOOM, at pp=2 x tp=2 (the bias reaches the later
stage as a layer input; microbatches of 1 row)."""
from torchpp.testing.model_checks import check_pp, check_tp

TIMEOUT_S = 300
FALCON_ALIBI = dict(multi_query=False, new_decoder_architecture=False, alibi=True, num_kv_heads=4)


def _tp_cases():
    return [check_tp("bloom", plan="auto"), check_tp("mpt", plan="auto"), check_tp("falcon", plan="auto", **FALCON_ALIBI),
            # Sequence parallelism: their attention and MLP add the residual (a sequence slice) inside.
            check_tp("bloom", plan="auto", sequence_parallel=True), check_tp("mpt", plan="auto", sequence_parallel=True),
            check_tp("cpmant", plan="auto")]


def test_alibi_attention_splits_at_tp2(ranks):
    for details in ranks(2).run(_tp_cases, timeout=TIMEOUT_S):
        assert [d.rpartition("linears split per layer: ")[2] for d in details] == [
            "BloomBlock 4/4", "MptBlock 4/4", "FalconDecoderLayer 4/4", "BloomBlock 4/4", "MptBlock 4/4",
            "CpmAntTransformerBlock 7/7"], details


# The plans "auto" derives, written by hand: the attention's head counts are divided as well.
BY_HAND = {
    "bloom": {"transformer.h.*.self_attention": "split_head_inputs(alibi)",
              "transformer.h.*.self_attention.query_key_value": "colwise",
              "transformer.h.*.self_attention.dense": "rowwise",
              "transformer.h.*.mlp.dense_h_to_4h": "colwise", "transformer.h.*.mlp.dense_4h_to_h": "rowwise"},
    "mpt": {"transformer.blocks.*.attn": "split_head_inputs(position_bias)",
            "transformer.blocks.*.attn.Wqkv": "packed3_colwise", "transformer.blocks.*.attn.out_proj": "rowwise",
            "transformer.blocks.*.ffn.up_proj": "colwise", "transformer.blocks.*.ffn.down_proj": "rowwise"},
}


def _by_hand_cases():
    return [check_tp(kind, plan=plan) for kind, plan in BY_HAND.items()]


def test_alibi_plans_by_hand_split_at_tp2(ranks):
    for details in ranks(2).run(_by_hand_cases, timeout=TIMEOUT_S):
        assert [d.partition(" grads, ")[2] for d in details] == ["24 sharded", "16 sharded"], details


def _style_by_hand_on_whole_attention():
    from torchpp.tensor_parallel.styles import PlanError

    plan = {"transformer.h.*.mlp.dense_h_to_4h": "colwise", "transformer.h.*.mlp.dense_4h_to_h": "rowwise",
            "transformer.h.*.self_attention": "split_head_inputs(alibi)"}  # its projections left whole
    try:
        check_tp("bloom", plan=plan)
    except PlanError as error:
        return str(error)
    return "no error"


def test_a_plan_cutting_the_bias_of_whole_attention_fails_clearly(ranks):
    for message in ranks(2).run(_style_by_hand_on_whole_attention, timeout=TIMEOUT_S):
        assert "transformer.h.0.self_attention has style 'split_head_inputs', but none of its projections" in message


def _pp_tp_case():
    import logging

    records = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger("torchpp")
    logger.addHandler(handler)
    level, logger.level = logger.level, logging.INFO
    try:
        result = check_pp("bloom", tp=2, plan="auto")
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    plan = next(r for r in records if "plan='auto'" in r)
    return result, "self_attention: split_head_inputs(alibi)" in plan and "BloomBlock 4/4" in plan


def test_alibi_attention_splits_under_the_pipeline(ranks):
    results = ranks(4).run(_pp_tp_case, timeout=TIMEOUT_S)
    assert all(split for _, split in results), results
    assert sum("loss" in result for result, _ in results) == 2, results  # the last stage's two TP ranks
