"""torchpp.models.parallelize on transformers' Llama, Mistral, Qwen2, Qwen3, Gemma 1 to 3, Phi-3
and GPT-2 equals the unwrapped model:
logits, loss and every gradient, under tp=2 (with and without sequence parallelism) and
pp=2 x tp=2 over the pipeline runtime; with fewer key/value heads than tp ranks (copies of each
head) at tp=2, tp=4 and pp=2 x tp=2."""
import copy

import torch
import torch.distributed as dist

import torchpp
from torchpp.models import parallelize
from hf_reference import (
    assert_grads_match, check_wrapped_step, hf_names, inputs_of, reference_step, tiny_model,
)
from tp_reference import assert_close

TIMEOUT_S = 150


def check_tp_equivalence(kind, sequence_parallel, inputs="plain", tp=2, kv_heads=2):
    state = torchpp.init_parallel(tp=tp, pp=1)
    model = tiny_model(kind, kv_heads=kv_heads)
    reference = copy.deepcopy(model)
    ids, labels, mask, positions = inputs_of(inputs, model.config.vocab_size)
    ref_logits, ref_loss, ref_grads = reference_step(reference, ids, labels, mask, positions)

    wrapped = parallelize(model, sequence_parallel=sequence_parallel, state=state)
    assert wrapped is model and isinstance(wrapped, type(reference)), "parallelize wraps the model in place"
    what = f"{kind} tp={tp} kv_heads={kv_heads} sp={sequence_parallel} inputs={inputs}"
    extras = dict(attention_mask=mask, position_ids=positions)
    with torch.no_grad():  # the model's own forward and output, full logits
        out = wrapped(input_ids=ids, labels=labels, use_cache=False, **extras)
    assert_close(out.logits, ref_logits, f"{what} logits")
    assert_close(out.loss, ref_loss, f"{what} forward loss")
    assert_close(wrapped.eval_step(ids, labels, **extras), ref_loss, f"{what} eval loss")
    assert all(p.grad is None for p in wrapped.parameters()), f"{what}: eval_step produced gradients"
    loss = wrapped.step(ids, labels, **extras)
    assert_close(loss, ref_loss, f"{what} loss")
    grads = wrapped.hf_state_dict(grads=True)
    # Every HF parameter is accounted for (tied lm_head included).
    assert set(grads) == hf_names(reference), f"{what}: {set(grads) ^ hf_names(reference)}"
    assert_grads_match(grads, ref_grads, what)
    values = wrapped.hf_state_dict()
    for name, param in reference.named_parameters(remove_duplicate=False):
        assert torch.equal(values[name], param.detach()), f"{what}: value of {name} changed"
    return True


def check_all_tp():
    for kind in ("llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "phi3", "gpt2"):
        check_tp_equivalence(kind, sequence_parallel=False)
    check_tp_equivalence("llama", sequence_parallel=True)
    check_tp_equivalence("gpt2", sequence_parallel=True)
    check_tp_equivalence("qwen3", sequence_parallel=True)
    check_tp_equivalence("gemma", sequence_parallel=True, inputs="padded")
    check_tp_equivalence("gemma2", sequence_parallel=True, inputs="padded")
    check_tp_equivalence("gemma3", sequence_parallel=True, inputs="packed")
    check_tp_equivalence("mixtral", sequence_parallel=True, inputs="padded")
    check_tp_equivalence("phi3", sequence_parallel=True, inputs="packed")
    # Padding (right and left): the attention_mask hides padded keys, as in transformers.
    check_tp_equivalence("llama", sequence_parallel=True, inputs="padded")
    check_tp_equivalence("mistral", sequence_parallel=False, inputs="padded")
    check_tp_equivalence("gpt2", sequence_parallel=False, inputs="padded")
    # Position ids: rotary and learned positions follow them; restarting within a row (no
    # mask), they pack sequences that attend only to themselves, as in transformers' training.
    check_tp_equivalence("llama", sequence_parallel=True, inputs="packed")
    check_tp_equivalence("mistral", sequence_parallel=False, inputs="packed")
    check_tp_equivalence("qwen2", sequence_parallel=True, inputs="packed")
    check_tp_equivalence("gpt2", sequence_parallel=True, inputs="packed")
    check_tp_equivalence("llama", sequence_parallel=False, inputs="padded_positions")
    return True


def check_errors():
    state = torchpp.init_parallel(tp=2, pp=1)
    from transformers import LlamaConfig, LlamaForCausalLM

    odd = LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=24, intermediate_size=32, num_hidden_layers=1,
                                       num_attention_heads=6, num_key_value_heads=3))
    try:
        parallelize(odd, state=state)
    except ValueError as error:
        assert "num_key_value_heads=3" in str(error) and "tp=2" in str(error), error
    else:
        raise AssertionError("tp=2 with three key/value heads must raise")
    try:
        parallelize(tiny_model("llama"), recompute="sometimes", state=state)
    except ValueError as error:
        assert "sometimes" in str(error)
    else:
        raise AssertionError("an unknown recompute mode must raise")
    return True


def check_vocab_padding():
    """VocabParallelEmbedding(pad_vocab=True) and cross entropy with vocab_size on V=7, tp=2."""
    import torch.nn.functional as F

    from torchpp.tensor_parallel import VocabParallelEmbedding, vocab_parallel_cross_entropy

    group, rank = dist.group.WORLD, dist.get_rank()
    torch.manual_seed(0)
    table = torch.nn.Embedding(7, 3)
    ids = torch.tensor([[0, 3, 4, 6]])
    sharded = VocabParallelEmbedding.from_embedding(table, pad_vocab=True, group=group)
    assert sharded.padded_num_embeddings == 8 and sharded.weight.shape == (4, 3)
    assert_close(sharded(ids), table(ids), "padded embedding forward")
    sharded(ids).sum().backward()
    table(ids).sum().backward()
    assert_close(sharded.weight.grad, torch.cat([table.weight.grad, torch.zeros(1, 3)]).chunk(2)[rank], "embedding grad")

    logits = torch.randn(5, 8)
    logits[:, 7] = 100.0  # a padded column that would dominate the softmax if it were kept
    target = torch.tensor([0, 6, 3, 4, 2])
    local = logits.chunk(2, dim=-1)[rank].clone().requires_grad_()
    full = logits[:, :7].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, target, group, reduction="mean", vocab_size=7)
    want = F.cross_entropy(full, target)
    assert_close(loss, want, "padded cross entropy")
    loss.backward()
    want.backward()
    assert_close(local.grad, torch.cat([full.grad, torch.zeros(5, 1)], dim=1).chunk(2, dim=-1)[rank], "CE grad")
    return True


def check_pipeline_equivalence(kind, schedule, recompute, tied, inputs="plain", sequence_parallel=False,
                               kv_heads=2):
    state = torchpp.init_parallel(tp=2, pp=2)
    model = tiny_model(kind, tied=tied, kv_heads=kv_heads)
    reference = copy.deepcopy(model)
    ids, labels, mask, positions = inputs_of(inputs, model.config.vocab_size)
    _, ref_loss, ref_grads = reference_step(reference, ids, labels, mask, positions)

    wrapped = parallelize(model, schedule=schedule, n_microbatches=4, recompute=recompute,
                          sequence_parallel=sequence_parallel, state=state)
    what = (f"{kind} pp=2 tp=2 {schedule} recompute={recompute} tied={tied} inputs={inputs} sp={sequence_parallel} "
            f"kv_heads={kv_heads} rank={dist.get_rank()}")
    return check_wrapped_step(wrapped, ids, labels, ref_loss, ref_grads, what, attention_mask=mask,
                              position_ids=positions)


PIPELINES = (
    ("llama", "1f1b", None, False, "plain"),
    ("gpt2", "zb-h1", "full", True, "plain"),  # tied embeddings on different ranks, split B/W
    ("mistral", "interleaved-1f1b", "selective", False, "plain"),
    ("gpt2", "zb-v", "selective", True, "plain"),  # tied embeddings on the same rank: one copy
    # Mask, positions and packed segments travel down the pipeline with the hidden states.
    ("llama", "zb-h1", "full", False, "padded"),
    ("mistral", "interleaved-1f1b", "selective", False, "padded"),
    ("llama", "1f1b", None, False, "packed"),
    ("gpt2", "zb-h1", None, False, "packed"),
    # Qwen2: sliding window on the second stage's layers only, tied embeddings on different ranks.
    ("qwen2", "zb-h1", "selective", True, "padded"),
    # Qwen3: per-head q/k norms, whose gradients each TP rank holds for its own heads only.
    ("qwen3", "interleaved-1f1b", "full", False, "packed"),
    # Gemma: scaled embeddings, tied on different ranks.
    ("gemma", "1f1b", "selective", True, "plain"),
    # Gemma 2: sandwich norms, capped scores and logits, windows on the first stage's layer 0 only.
    ("gemma2", "zb-h1", "selective", True, "padded"),
    # Gemma 3: each stage computes the rotary tables of the layer types it holds.
    ("gemma3", "interleaved-1f1b", "full", False, "padded"),
    # Mixtral: experts split over TP (not split B/W: their weight gradients come with I).
    ("mixtral", "zb-h1", "selective", False, "packed"),
    # Phi-3: fused qkv and gate_up projections, their rows regrouped per TP rank, split B/W.
    ("phi3", "zb-h1", None, False, "padded"),
    # Sequence parallelism: each TP rank sends its own sequence slice down the pipeline.
    ("llama", "zb-h1", "selective", False, "padded", True),
    ("gpt2", "interleaved-1f1b", None, True, "packed", True),
    # DualPipe: each rank holds stages r and p-1-r, each stage is on two ranks, both ends hold the loss.
    ("llama", "dualpipe", None, False, "padded"),
    ("gpt2", "dualpipe", "selective", True, "plain"),
)


def _relative_error(got, want):
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()


def check_pipeline_autocast(kind, schedule, dtype=torch.bfloat16, pp=2, loss_scale=None):
    """Autocast (bf16, or fp16 with a loss scale) around the step and around the unwrapped
    model. TP's partial products round in low precision before their all-reduce, so the two
    agree to that precision, not bit for bit; returns the worst relative errors (loss,
    gradients, unscaled) against that reference and the smallest against the fp32 one (which
    shows autocast was in force)."""
    from torchpp.parallel import GradScaler

    state = torchpp.init_parallel(tp=2, pp=pp)
    model = tiny_model(kind)
    reference, fp32_reference = copy.deepcopy(model), copy.deepcopy(model)
    ids, labels, mask, positions = inputs_of("plain", model.config.vocab_size)
    with torch.autocast("cpu", dtype=dtype):
        _, ref_loss, ref_grads = reference_step(reference, ids, labels)
    _, _, fp32_grads = reference_step(fp32_reference, ids, labels)
    scaler = GradScaler("cpu", init_scale=loss_scale) if loss_scale else None
    wrapped = parallelize(model, schedule=schedule, n_microbatches=4, state=state, grad_scaler=scaler)
    with torch.autocast("cpu", dtype=dtype):
        loss = wrapped.step(ids, labels)
    grads = wrapped.hf_state_dict(grads=True)
    assert grads and all(g.dtype == torch.float32 for g in grads.values())
    if loss_scale:  # the backward ran scaled: the gradients are loss_scale times the batch's
        grads = {n: g / loss_scale for n, g in grads.items()}
    loss_error = _relative_error(loss, ref_loss) if wrapped.has_last_stage else 0.0
    return (loss_error, max(_relative_error(g, ref_grads[n]) for n, g in grads.items()),
            max(_relative_error(g, fp32_grads[n]) for n, g in grads.items()))


def test_pp2_tp2_under_bf16_autocast_matches_unwrapped_to_bf16_precision(ranks):
    per_rank = ranks(4).run(check_pipeline_autocast, "llama", "zb-h1", timeout=TIMEOUT_S)
    loss_error = max(r[0] for r in per_rank)
    grad_error = max(r[1] for r in per_rank)
    assert loss_error < 1e-2 and grad_error < 5e-2, per_rank
    assert max(r[2] for r in per_rank) > 1e-3, per_rank  # without autocast the gradients differ


def check_fp16_layouts():
    return [check_pipeline_autocast("llama", "zb-h1", torch.float16, pp=2, loss_scale=2.0**12),
            check_pipeline_autocast("llama", "1f1b", torch.float16, pp=1, loss_scale=2.0**12)]


def test_fp16_loss_scaling_through_parallelize_matches_unwrapped_to_fp16_precision(ranks):
    """pp2 x tp2 (the schedule scales each loss seed) and tp=2 without a pipeline (the step
    scales its backward): gradients divided by the scale are the unwrapped fp16 ones."""
    for layout in zip(*ranks(4).run(check_fp16_layouts, timeout=TIMEOUT_S)):
        assert max(r[0] for r in layout) < 1e-2 and max(r[1] for r in layout) < 5e-2, layout
        assert max(r[2] for r in layout) > 1e-4, layout  # fp16 moved the gradients off the fp32 ones


def check_all_pipelines():
    names = []
    for case in PIPELINES:
        names.append(check_pipeline_equivalence(*case))
    return names


def check_kv_copies_tp2():
    """One key/value head (MQA) at tp=2: each rank holds a copy of it. Llama (k/v biases),
    Qwen3 (a norm over each key head), Gemma, with and without SP."""
    for kind, sequence_parallel, inputs in (("llama", False, "plain"), ("llama", True, "padded"),
                                            ("qwen3", True, "packed"), ("gemma", False, "padded")):
        check_tp_equivalence(kind, sequence_parallel, inputs, kv_heads=1)
    return True


def check_kv_copies_4_ranks():
    """Two key/value heads at tp=4 (each on two ranks); one at pp=2 x tp=2 under zb-h1 (split B/W:
    the copies' weight gradients come in W passes, summed after the step)."""
    check_tp_equivalence("mistral", True, "padded", tp=4, kv_heads=2)
    check_tp_equivalence("qwen2", False, "packed", tp=4, kv_heads=2)
    check_pipeline_equivalence("llama", "zb-h1", "selective", False, "padded", True, kv_heads=1)
    check_pipeline_equivalence("qwen3", "interleaved-1f1b", None, False, "plain", kv_heads=1)
    return True


def test_kv_heads_copied_when_tp_exceeds_them(ranks):
    assert ranks(2).run(check_kv_copies_tp2, timeout=TIMEOUT_S) == [True, True]
    assert ranks(4).run(check_kv_copies_4_ranks, timeout=TIMEOUT_S) == [True] * 4


def test_tp2_matches_unwrapped_hf_models(ranks):
    assert ranks(2).run(check_all_tp, timeout=TIMEOUT_S) == [True, True]


def test_clear_errors(ranks):
    assert ranks(2).run(check_errors, timeout=60) == [True, True]


def test_vocab_padding_embedding_and_cross_entropy(ranks):
    assert ranks(2).run(check_vocab_padding, timeout=60) == [True, True]


def test_pp2_tp2_pipeline_matches_unwrapped(ranks):
    per_rank = ranks(4).run(check_all_pipelines, timeout=TIMEOUT_S)
    models = [(case[0], case[3]) for case in PIPELINES]
    assert all(len(names) == len(models) for names in per_rank)
    for case, (kind, tied) in enumerate(models):
        covered = set().union(*(set(names[case]) for names in per_rank))
        # The stages together hold every parameter of the model.
        assert covered == hf_names(tiny_model(kind, tied=tied)), f"case {case}: {covered}"
