"""parallelize(model, cp=): transformers causal LMs with the sequence split over context-parallel
ranks, each cp group given its batch whole. Llama and Qwen2 at cp=2, cp=2 x tp=2 (Qwen2 with
sequence parallelism), cp=2 x pp=2 (zb-h1) and Llama at cp=2 x dp=2 (also under ZeRO-2 and
ZeRO-3, sharded over dp x cp); MoE models with their experts split over the cp (and dp) ranks
(ep=2 at cp=2, ep=4 at cp=2 x dp=2); both attention modes and
layouts, packed sequences (position ids restarting) and selective recompute. Each equals the
unwrapped model in float64: loss, logits (gathered over cp), every gradient after
DistributedOptimizer's reduction over the dp-cp group, and one SGD step
(torchpp.testing.model_checks.check_cp). Sliding windows, attention sinks (GPT-OSS, also at cp=2
x tp=2 and x pp=2) and Llama 4's chunked layers too. Bad inputs raise on every rank naming the
value; what sharded attention cannot do (an indexer it does not know) raises naming it. DeepSeek
Sparse Attention (an indexer picking each query's keys) with its keys gathered, and DeepSeek-V4's
compressed entries over windows spanning ranks, at cp=2, cp=4, cp=2 x tp=2 and cp=2 x pp=2; MLA's
keys and values of different widths; Inkling's relative position biases from global distances; Doge's
dynamic mask from gathered per-key biases. Gemma 2's capped scores (and VaultGemma's) with their sliding layers; LFM2-family
short convolutions (and ZAYA's convolutional attention projection) run chunk by chunk with the tokens
before each (halos), at cp=2, cp=4 and cp=2 x tp=2;
gated delta-rule hybrids (Qwen3.5, Qwen3-Next, OLMo hybrid, Lara, Kimi Linear, Bailing hybrid) with each chunk's recurrence
started from the state the earlier chunks leave, at cp=2, cp=4, cp=2 x tp=2 and cp=2 x pp=2;
Mamba-2 mixers likewise (Mamba-2, Nemotron-H, Bamba, Falcon-H1, Granite 4 hybrid, Zamba2); RWKV's WKV
and xLSTM's mLSTM.
Models counting their own positions (RoBERTa's from the tokens, BART's decoders from the length)
read the whole sequence's, at cp=2, cp=4 and cp=2 x pp=2; models computing attention in their
own code (Falcon, GPT-Neo, Bloom and MPT with ALiBi, MegatronBERT, RemBERT, RoFormer, BigBird's full
attention, MVP, TrOCR, XLM) have their
softmax routed to sharded attention. The wrapped forward under torch.compile (aot_eager): ring, all-to-all,
experts split over cp; decoder layers compiled whole on packed rows, following each batch's packing."""
import copy

import pytest
import torch

import torchpp
from torchpp.models import parallelize
from torchpp.testing.model_checks import (SEQ, assert_close, batch, check_cp, decoder_layers, packed_positions,
                                         precision)
from torchpp.testing.tiny_models import tiny_model

TIMEOUT_S = 300


def check_cp2_cases():
    done = {}
    for model_type in ("llama", "qwen2"):
        done[model_type] = check_cp(model_type)
    done["llama contiguous all-gather"] = check_cp("llama", mode="all-gather", layout="contiguous")
    done["llama packed"] = check_cp("llama", packed=True)
    done["qwen2 packed all-gather"] = check_cp("qwen2", packed=True, mode="all-gather")
    done["llama selective recompute"] = check_cp("llama", recompute="selective")
    # All-to-all (Ulysses): each rank attends with half the heads over the whole sequence.
    done["llama packed all-to-all"] = check_cp("llama", packed=True, mode="all-to-all")
    done["qwen2 contiguous all-to-all selective recompute"] = check_cp("qwen2", layout="contiguous", mode="all-to-all",
                                                                       recompute="selective")
    # (a config whose head count is per layer, which the wrap-time check of the heads cannot read)
    done["dots3_note_text all-to-all"] = check_cp("dots3_note_text", mode="all-to-all")
    return done


# Other families by their own modeling code: q/k norms (qwen3, olmo2), partial rotary (phi, gpt_neox),
# layers without rotary (smollm3), scaled embeddings (gemma), fused qkv (phi3), all on packed rows.
FAMILIES = ("qwen3", "olmo2", "phi", "gpt_neox", "smollm3", "gemma", "phi3")


def check_families():
    return {model_type: check_cp(model_type, packed=True) for model_type in FAMILIES}


def check_cp_with(dim: str, model_type: str):
    if dim == "tp":
        return check_cp(model_type, tp=2, sequence_parallel=model_type == "qwen2")
    if dim == "dp":
        return check_cp(model_type, dp=2, packed=True)
    if dim == "zero":  # gradients reduce-scattered (ZeRO-2), parameters sharded too (ZeRO-3) over dp x cp
        return [check_cp(model_type, dp=2, zero=zero) for zero in (2, 3)]
    if dim == "ep":  # the experts split over all four dp x cp ranks, each rank routing its own shard's tokens
        return check_cp(model_type, dp=2, ep=4)
    return check_cp(model_type, pp=2, schedule="zb-h1", n_microbatches=2, packed=model_type == "qwen2")


class OtherIndexer(torch.nn.Module):
    pass


def check_errors():
    state = torchpp.init_parallel(cp=2)
    model = parallelize(tiny_model("llama"), state=state)
    ids = torch.zeros(2, 16, dtype=torch.long)
    with pytest.raises(ValueError, match=r"length 18 is not divisible by 4"):
        model(input_ids=torch.zeros(2, 18, dtype=torch.long))
    with pytest.raises(ValueError, match="attention_mask holds padding"):
        model(input_ids=ids, attention_mask=torch.tensor([[1] * 16, [0] * 4 + [1] * 12]))
    with pytest.raises(ValueError, match="use_cache=False"):
        model(input_ids=ids, use_cache=True)
    # Ranks given different rows (a loader sharding over every rank): each raises, none waits on the others.
    rank = state.cp_group.rank()
    with pytest.raises(ValueError, match=r"cp group \[0, 1\] were given different batches \(their tokens differ"):
        model(input_ids=ids + rank)
    packed_on_one = packed_positions(2, 16) if rank == 0 else None  # (once a hang: one rank exchanged segment ids)
    with pytest.raises(ValueError, match=r"different batches \(their position ids differ"):
        model(input_ids=ids, position_ids=packed_on_one)
    with pytest.raises(ValueError, match=r"different batches \(their rows, tokens differ"):
        model(input_ids=torch.zeros(2 + rank, 16, dtype=torch.long) + rank)
    with pytest.raises(ValueError, match="cp_mode must be one of"):
        parallelize(tiny_model("llama"), state=state, cp_mode="tree")
    with pytest.raises(ValueError, match=r"cp_mode='all-to-all' .* num_attention_heads=3 over tp=1 leaves 3 per tp "
                                         r"rank, which cp=2 does not divide"):
        parallelize(tiny_model("llama", num_attention_heads=3, num_key_value_heads=1, hidden_size=48), state=state,
                    cp_mode="all-to-all")
    with pytest.raises(ValueError, match=r"cp_mode='all-to-all\+ring' .* num_attention_heads=3 over tp=1 leaves 3 "
                                         r"per tp rank, which cp_all_to_all_size=2 does not divide"):
        parallelize(tiny_model("llama", num_attention_heads=3, num_key_value_heads=1, hidden_size=48), state=state,
                    cp_mode="all-to-all+ring", cp_all_to_all_size=2)
    with pytest.raises(ValueError, match=r"size must divide 2, got all_to_all_size=4"):
        parallelize(tiny_model("llama"), state=state, cp_mode="all-to-all+ring", cp_all_to_all_size=4)
    with pytest.raises(ValueError, match="cp_mode='all-to-all\\+ring' needs cp_all_to_all_size"):
        parallelize(tiny_model("llama"), state=state, cp_mode="all-to-all+ring")
    with pytest.raises(ValueError, match=r"cp_all_to_all_size=2 sizes the all-to-all groups .* not of cp_mode='ring'"):
        parallelize(tiny_model("llama"), state=state, cp_all_to_all_size=2)
    with pytest.raises(ValueError, match="needs attention_dropout=0"):
        parallelize(tiny_model("llama", attention_dropout=0.1), state=state)
    with pytest.raises(NotImplementedError, match="load-balancing loss .* not supported with cp=2"):
        parallelize(tiny_model("mixtral", output_router_logits=True), state=state)
    unknown = tiny_model("deepseek_v32")
    unknown.model.layers[1].self_attn.indexer = OtherIndexer()  # one whose keys torchpp does not know to gather
    with pytest.raises(NotImplementedError, match=r"'indexed_attention' use sparse attention whose indexer "
                                                  r"\(OtherIndexer\) is not one whose keys torchpp gathers"):
        parallelize(unknown, state=state)
    with pytest.raises(ValueError, match=r"cp=4 disagree with the parallel state \(tp=1, pp=1, cp=2, ep=1\)"):
        parallelize(tiny_model("llama"), cp=4, state=state)
    return True


def test_cp2_llama_qwen2_modes_layouts_packed(ranks):
    results = ranks(2).run(check_cp2_cases, timeout=TIMEOUT_S)
    assert all(len(r) == 9 for r in results), results


def check_compiled_models():
    return {"gpt_oss ring": check_cp("gpt_oss", sliding_window=3, compiled=True),
            "llama all-to-all packed": check_cp("llama", packed=True, mode="all-to-all", compiled="layers"),
            "qwen2_moe ep=2": check_cp("qwen2_moe", ep=2, compiled=True)}


def test_cp2_compiled_models(ranks):
    """The wrapped model's forward under torch.compile (aot_eager) equals the unwrapped model: GPT-OSS
    with the ring (sinks and windows: blocks on the matmul path, whose contiguous output the fake
    kernels once gave the query's strides, so the compiled backward's views failed), Llama with
    all-to-all (whose exchanges once traced into c10d's in-place collectives, whose writes the
    functional graph dropped: NaN logits), and Qwen2-MoE with experts split over the cp ranks (run
    eagerly inside the compiled model: their sizes depend on the routing; fake tensors once failed
    on them). Llama's decoder layers are compiled each whole (fullgraph) on packed rows: whether rows
    are packed is decided once, where the batch is sharded, not by a data-dependent branch in every
    layer (which broke the graph). Every mode's op compiled whole: test_context_parallel_attention.py."""
    results = ranks(2).run(check_compiled_models, timeout=TIMEOUT_S)
    assert all(len(r) == 3 for r in results), results


def check_compiled_layers_follow_each_batch():
    """Layers compiled whole, called with rows packed one way, then unpacked (no position ids, and
    given ones counting from 0), then packed another way: each forward's logits equal the unwrapped
    model's, so no compiled layer keeps an earlier batch's segments."""
    from torchpp.context_parallel import unshard_sequence

    with precision(torch.float64):
        state = torchpp.init_parallel(cp=2)
        model = tiny_model("llama")
        reference = copy.deepcopy(model)
        ids, _ = batch(model.config.vocab_size, seq_len=SEQ)
        wrapped = parallelize(model, state=state)
        torch._dynamo.reset()
        for layer in decoder_layers(wrapped):
            layer.compile(backend="aot_eager", fullgraph=True)
        packed = packed_positions(ids.size(0), SEQ)
        counting = torch.arange(SEQ).expand(ids.size(0), -1)
        for name, positions in [("packed", packed), ("none", None), ("from 0", counting), ("packed flipped", packed.flip(0))]:
            out = wrapped(input_ids=ids, position_ids=positions, use_cache=False)
            expected = reference(input_ids=ids, position_ids=positions, use_cache=False).logits
            assert_close(unshard_sequence(out.logits, state.cp_group, dim=1), expected, f"compiled layers, {name} rows")
    return "equal"


def test_compiled_layers_follow_each_batch(ranks):
    assert ranks(2).run(check_compiled_layers_follow_each_batch, timeout=TIMEOUT_S) == ["equal"] * 2

def test_cp2_more_families_packed(ranks):
    results = ranks(2).run(check_families, timeout=TIMEOUT_S)
    assert all(set(r) == set(FAMILIES) for r in results), results


def check_all_to_all_at(dims: str):
    if dims == "cp4":  # one of the 4 heads per rank; Mistral's 2 key/value heads repeated; hierarchical 2 x 2
        return [check_cp("llama", cp=4, packed=True, mode="all-to-all"),
                check_cp("mistral", cp=4, sliding_window=5, mode="all-to-all", layout="contiguous"),
                check_cp("qwen2", cp=4, packed=True, mode="all-to-all+ring", all_to_all_size=2, recompute="selective")]
    if dims == "cp2xtp2":  # a tp rank's 2 heads over the cp ranks
        return [check_cp("llama", tp=2, mode="all-to-all")]
    done = [check_cp("mistral", pp=2, mode="all-to-all", packed=True)]
    # (and a base model, which cp takes at pp=1 only: refused under a pipeline, named)
    torchpp.destroy_parallel()
    with pytest.raises(ValueError, match=r"cp=2 with pp=2 needs a transformers causal LM.* EuroBertModel is a base"):
        parallelize(tiny_model("eurobert"), state=torchpp.init_parallel(cp=2, pp=2))
    return done


@pytest.mark.parametrize("dims", ["cp4", "cp2xtp2", "cp2xpp2"])
def test_all_to_all_at_cp4_and_with_tp_pp(ranks, dims):
    results = ranks(4).run(check_all_to_all_at, dims, timeout=TIMEOUT_S)
    assert len(results) == 4 and all("grads on this rank" in r for done in results for r in done), results


def check_without_backend_flag():
    """Models that do not declare attention backends (_supports_attention_backend False) but run
    attention through transformers' functions and take position ids: StableLM (partial rotary),
    BioGPT (learned positions, scaled embeddings; packed: tests/faults/test_context_parallel_masks.py)."""
    return {"stablelm packed": check_cp("stablelm", packed=True, plan="auto"), "biogpt": check_cp("biogpt", plan="auto")}


def test_cp2_models_without_the_attention_backend_flag(ranks):
    results = ranks(2).run(check_without_backend_flag, timeout=TIMEOUT_S)
    assert all(len(r) == 2 for r in results), results


def check_base_models():
    """Base models (no head: the wrapped model returns this rank's shard of the hidden states):
    EuroBERT, a bidirectional encoder; Qwen2-VL's text model on packed rows (3-D rotary positions
    from 2-D position ids); Mistral 4's MoE text model. Their hidden states gathered over cp equal
    the unwrapped model's; a fixed probe of them is the loss (check_cp). With a pipeline a base
    model is refused (its step has no batch to shard), naming it: check_all_to_all_at("cp2xpp2").
    EmbeddingGemma2's bidirectional sliding windows (|i - j| <= config.sliding_window, as its mask
    has them, though it hands its attention function one more); T5Gemma2's encoder masks an
    asymmetric window of its own: refused, naming it. Mistral Large 4's text model: sparse indexed
    attention whose indexer rotates interleaved and scales its queries by position (its keys gathered)."""
    done = {"eurobert": check_cp("eurobert"), "qwen2_vl_text packed": check_cp("qwen2_vl_text", packed=True),
            "mistral4": check_cp("mistral4"), "embedding_gemma2_text": check_cp("embedding_gemma2_text"),
            "mistral_large4_text": check_cp("mistral_large4_text")}
    torchpp.destroy_parallel()
    with pytest.raises(NotImplementedError, match=r"T5Gemma2SelfAttention asks for a sliding window 8 on bidirectional "
                                                  r"attention whose mask its model builds itself"):
        check_cp("t5gemma2_text")
    return done


def test_cp2_base_models(ranks):
    results = ranks(2).run(check_base_models, timeout=TIMEOUT_S)
    assert all(len(r) == 5 for r in results), results


def check_own_positions():
    """Models that count their positions themselves: RoBERTa's embeddings from the tokens (from
    padding_idx + 1 over the non-padding ones; the random ids hold padding tokens, and packed rows
    take the given position ids as they are, which RoBERTa's mask does not split by), BART-family
    decoders and Whisper's from their input's length (their own per-token loss: each token's
    logits against its own label). BART's and BigBirdPegasus's own cases are in
    tests/faults/test_context_parallel_masks.py."""
    done = {name: check_cp(name, plan="auto", packed=packed) for name, packed in
            [("roberta", False), ("xmod", True), ("camembert", False), ("marian", False), ("whisper", False)]}
    with pytest.raises(ValueError, match=r"BartForCausalLM counts its positions from its input's length \(0\.\.15"):
        check_cp("bart", plan="auto", packed=True)
    return done


def check_own_attention_code():
    """Falcon (rotary or ALiBi; multi-query and the new decoder architecture's grouped heads), GPT-Neo
    (unscaled scores, local layers a window of 5 here), GPT-NeoX-Japanese, Bloom and MPT (ALiBi: the op's slopes;
    Bloom with 3 heads too, slopes not powers of 2) compute attention in their own code; their
    softmax is routed to sharded attention. GPT-Neo computes its scores in float32, Bloom and MPT
    their softmax, whatever the model's dtype: their cases run in float32, at float32's tolerance."""
    fp32 = dict(plan="auto", dtype=torch.float32)
    done = {"falcon packed": check_cp("falcon", plan="auto", packed=True),
            "falcon new architecture": check_cp("falcon", plan="auto", new_decoder_architecture=True, num_kv_heads=2),
            # Falcon's ALiBi, rounded to bfloat16 by its model (past 256 keys no slope gives it): its bias
            # rebuilt over every key; transformers' eager path adds it twice, as the wrapped model then does.
            "falcon alibi packed": check_cp("falcon", plan="auto", alibi=True, packed=True),
            "falcon alibi eager 600 tokens": check_cp("falcon", plan="auto", alibi=True, seq_len=600,
                                                      attn_implementation="eager"),
            "gpt_neo packed": check_cp("gpt_neo", packed=True, window_size=5, **fp32),
            "gpt_neox_japanese packed": check_cp("gpt_neox_japanese", plan="auto", packed=True),
            "gpt_neo all-gather contiguous": check_cp("gpt_neo", mode="all-gather", layout="contiguous", window_size=5,
                                                      **fp32),
            "bloom": check_cp("bloom", **fp32), "bloom 3 heads": check_cp("bloom", n_head=3, hidden_size=48, **fp32),
            "mpt all-gather contiguous": check_cp("mpt", mode="all-gather", layout="contiguous", **fp32),
            # BERT-style self-attention, bidirectional as the model is built (causal as a decoder: its
            # mask does not split packed rows, so neither does sharded attention); BART's copies, whose
            # decoders count positions themselves (handed the global ones).
            "rembert bidirectional": check_cp("rembert", plan="auto"),
            "megatron-bert decoder packed": check_cp("megatron-bert", plan="auto", is_decoder=True, packed=True),
            "mvp": check_cp("mvp", plan="auto"), "trocr": check_cp("trocr", plan="auto"),
            # TrOCR's sinusoidal table counts the non-padding tokens it is given (the random ids hold
            # padding): it counts every rank's, gathered (once, though selective recompute applies cp twice).
            "trocr sinusoidal recompute": check_cp("trocr", plan="auto", use_learned_position_embeddings=False,
                                                   recompute="selective"),
            # RoFormer's rotary from a sinusoidal table its encoder counts from the length (handed the
            # global positions; rotated values too).
            "roformer decoder rotary values": check_cp("roformer", plan="auto", is_decoder=True, rotary_value=True),
            "xlm causal packed": check_cp("xlm", plan="auto", causal=True, packed=True),
            "big_bird full attention": check_cp("big_bird", plan="auto", attention_type="original_full")}
    with pytest.raises(ValueError, match=r"BloomForCausalLM counts its positions from its input's length"):
        check_cp("bloom", packed=True, **fp32)  # its biases count keys by index: packed rows are refused
    with pytest.raises(NotImplementedError, match=r"BigBirdForCausalLM uses block-sparse attention"):
        check_cp("big_bird", plan="auto")
    return done


def check_outside_attention_functions():
    return {**check_own_positions(), **check_own_attention_code()}


def test_cp2_models_counting_positions_or_attending_in_their_own_code(ranks):
    results = ranks(2).run(check_outside_attention_functions, timeout=TIMEOUT_S)
    assert all(len(r) == 23 and all("grads on this rank" in d for d in r.values()) for r in results), results


def check_sparse_attention():
    """DeepSeek Sparse Attention: each query attends to the top 8 of its 16 keys an indexer picks
    (its scores against every rank's keys, gathered), and MLA's keys wider or narrower than its values.
    DeepSeek-V3.2 and GLM-MoE-DSA (MLA; packed rows), HY-V4 (attention sinks), AXK2, Dots3 Note
    (sliding layers besides, keys 32 wide and values 16 through the ring), Qwen4-Exp's QSA (2 of a
    query's blocks of 4 keys, pooled and rotated at their global positions, plus its open block's
    keys; gated delta-rule layers besides), DeepSeek-V3 with values narrower and wider than its keys. Attending to every visible key instead of the chosen ones, or
    keeping only this rank's part of the gathered keys' gradient, fails these."""
    return {"deepseek_v32 packed": check_cp("deepseek_v32", packed=True), "glm_moe_dsa": check_cp("glm_moe_dsa"),
            "hy_v4 contiguous": check_cp("hy_v4", layout="contiguous"),
            "axk2 all-gather": check_cp("axk2", mode="all-gather"), "dots3_note": check_cp("dots3_note"),
            "qwen4_exp (blocks pooled, a mask) packed": check_cp("qwen4_exp", plan="auto", packed=True),
            "deepseek_v3 narrow values": check_cp("deepseek_v3", v_head_dim=8),
            "deepseek_v3 wide values packed": check_cp("deepseek_v3", v_head_dim=24, packed=True),
            **check_compressed_attention(), **check_relative_biases(),
            # Doge's dynamic mask: per-key biases from the values, gathered; each query keeps its 3 keys of
            # largest bias (the model's own top-k, on this rank's rows of the mask).
            "doge packed": check_cp("doge", keep_window_size=3, packed=True)}


def check_relative_biases():
    """Inkling's and Inkling 2's relative position biases (a bias per backward distance, here up to 8
    on sliding layers and 32 on full ones) from global distances, over the gathered keys; Inkling 2's
    per-token sinks and its attention residuals across depth (each token over its own blocks'
    states, run as the model's eager attention). Handing the bias the shard's own distances, or
    dropping the sinks, fails these. Inkling's log-scaled full attention counts positions in its
    own code: refused."""
    done = {"inkling packed": check_cp("inkling_text", packed=True),
            "inkling2 packed all-gather contiguous": check_cp("inkling2_text", plan="auto", packed=True,
                                                              mode="all-gather", layout="contiguous")}
    with pytest.raises(NotImplementedError, match=r"InklingForCausalLM scales its full-attention queries and biases "
                                                  r"by log\(position\)"):
        check_cp("inkling_text", log_scaling_n_floor=4)
    return done


# DeepSeek-V4's layer kinds: a sliding window of 5 alone; with heavily compressed entries (one per
# 8 tokens); with compressed entries (one per 2 tokens, overlapping) of which an indexer keeps 3.
V4_LAYERS = dict(index_topk=3, sliding_window=5, layer_types=["sliding_attention", "heavily_compressed_attention",
                                                               "sliding_attention", "compressed_sparse_attention"])


def check_compressed_attention():
    """DeepSeek-V4: windows of the compressors span ranks (their projections gathered, each rank
    compressing the whole sequence as one process does); one softmax with sinks over the sliding
    window's keys and the compressed entries its position has closed. Not gathering the
    projections, or dropping the model's bias over the entries, fails these."""
    return {"deepseek_v4": check_cp("deepseek_v4", **V4_LAYERS),
            "deepseek_v4 packed all-gather contiguous": check_cp("deepseek_v4", packed=True, mode="all-gather",
                                                                  layout="contiguous", index_topk=3)}


def test_cp2_attention_to_keys_beyond_the_shard_sparse_compressed_or_biased_and_mla_widths(ranks):
    results = ranks(2).run(check_sparse_attention, timeout=TIMEOUT_S)
    assert all(len(r) == 13 and all("grads on this rank" in d for d in r.values()) for r in results), results


def check_outside_attention_functions_at(dims: str):
    fp32 = dict(plan="auto", dtype=torch.float32)
    if dims == "cp4":  # RoBERTa's count carried over eight chunks; windows of 3 over chunks of 2 tokens
        return [check_cp("xlm-roberta", cp=4, plan="auto"), check_cp("pegasus", cp=4, plan="auto"),
                check_cp("gpt_neo", cp=4, window_size=3, **fp32), check_cp("falcon", cp=4, plan="auto", packed=True),
                check_cp("bloom", cp=4, **fp32), check_cp("glm_moe_dsa", cp=4, packed=True),
                check_cp("deepseek_v4", cp=4, **V4_LAYERS), check_cp("inkling2_text", cp=4, plan="auto")]
    if dims == "cp2xpp2":  # (RoBERTa's and MPT's: tests/faults/test_context_parallel_masks.py)
        return [check_cp("bart", pp=2, schedule="1f1b", plan="auto"),
                check_cp("falcon", pp=2, plan="auto", packed=True), check_cp("hy_v4", pp=2, schedule="1f1b"),
                check_cp("deepseek_v4", pp=2, index_topk=3)]
    # Under tp each rank's ALiBi slopes are its heads' (read from the bias rows the model cut to them).
    return [check_cp("falcon", tp=2, plan="auto", alibi=True), check_cp("bloom", tp=2, **fp32),
            check_cp("gpt_neo", tp=2, window_size=5, recompute="selective", **fp32),
            check_cp("deepseek_v32", tp=2, recompute="selective"),
            check_cp("deepseek_v4", tp=2, recompute="selective", **V4_LAYERS)]


@pytest.mark.parametrize("dims", ["cp4", "cp2xpp2", "cp2xtp2"])
def test_outside_attention_functions_at_cp4_and_with_tp_pp(ranks, dims):
    results = ranks(4).run(check_outside_attention_functions_at, dims, timeout=TIMEOUT_S)
    assert len(results) == 4 and all(len(r) == {"cp4": 8, "cp2xpp2": 4, "cp2xtp2": 5}[dims] for r in results), results


@pytest.mark.parametrize("dim,model_type", [("tp", "llama"), ("tp", "qwen2"), ("pp", "llama"), ("pp", "qwen2"),
                                            ("dp", "llama"), ("zero", "llama"), ("ep", "mixtral")])
def test_cp2_with_tp2_pp2_or_dp2(ranks, dim, model_type):
    results = ranks(4).run(check_cp_with, dim, model_type, timeout=TIMEOUT_S)
    assert len(results) == 4 and all(isinstance(r, (str, list)) for r in results), results


SOFTCAP = 0.02


def check_masks():
    """Sliding windows (Mistral's on every layer, Gemma 3's and GPT-OSS's on some), GPT-OSS's attention
    sinks, Llama 4's chunked layers, Gemma 2's capped scores, on packed rows too and in both modes and
    layouts."""
    return {"mistral": check_cp("mistral", sliding_window=5),
            "mistral packed all-gather": check_cp("mistral", sliding_window=5, packed=True, mode="all-gather"),
            "gemma3 packed": check_cp("gemma3_text", sliding_window=3, packed=True),
            "gpt_oss": check_cp("gpt_oss", sliding_window=3),
            "gpt_oss contiguous": check_cp("gpt_oss", sliding_window=6, layout="contiguous"),
            "llama4 chunks": check_cp("llama4_text", attention_chunk_size=4),
            "llama4 chunks contiguous": check_cp("llama4_text", attention_chunk_size=6, layout="contiguous"),
            "llama4 chunks packed all-gather": check_cp("llama4_text", attention_chunk_size=4, packed=True,
                                                        mode="all-gather"),
            # A cap low enough to bend these small scores: ignoring it fails the comparison.
            "gemma2 capped packed": check_cp("gemma2", attn_logit_softcapping=SOFTCAP, sliding_window=3, packed=True),
            "gemma2 capped all-to-all": check_cp("gemma2", attn_logit_softcapping=SOFTCAP, sliding_window=3,
                                                 mode="all-to-all"),
            "vaultgemma capped all-gather": check_cp("vaultgemma", attn_logit_softcapping=SOFTCAP, sliding_window=5,
                                                     mode="all-gather", layout="contiguous")}


def test_cp2_windows_sinks_and_chunks(ranks):
    results = ranks(2).run(check_masks, timeout=TIMEOUT_S)
    assert all(len(r) == 11 for r in results), results


CONV_LAYERS = ["conv", "full_attention", "conv", "full_attention"]


def check_short_convolutions():
    """LFM2-family short convolutions, each chunk run with the tokens before it from their ranks:
    kernel 3 with biases on packed rows, LFM3's kernel 7 reaching over two chunks of 4 (and both
    chunks of the rank before the first one), LFM2-MoE in the other mode and layout; ZAYA's attention
    projection (a depthwise then a grouped convolution over queries and keys, kernels 3 and 3: four
    tokens back, and half of each value head from the token before; summing only the first kernel's
    reach fails it), on packed rows."""
    return {"lfm2 packed": check_cp("lfm2", layer_types=CONV_LAYERS, conv_bias=True, packed=True),
            "lfm3 kernel 7": check_cp("lfm3", conv_bias=True),
            "lfm2_moe contiguous all-gather": check_cp("lfm2_moe", mode="all-gather", layout="contiguous"),
            "zaya packed": check_cp("zaya", plan="auto", cca_time0=3, cca_time1=3, packed=True)}


def test_cp2_short_convolutions_with_halos(ranks):
    results = ranks(2).run(check_short_convolutions, timeout=TIMEOUT_S)
    assert all(len(r) == 4 for r in results), results


def check_short_convolutions_at(dims: str):
    if dims == "cp4":  # chunks of 2 tokens: a kernel-7 halo spans three chunks held by three ranks
        return [check_cp("lfm3", cp=4, conv_bias=True), check_cp("zaya", cp=4, plan="auto", cca_time0=3, cca_time1=3)]
    if dims == "cp2xpp2":  # LFM2 ties its embedding and head: their group, one per cp rank (a hang before)
        return check_cp("lfm2", pp=2, plan="auto", layer_types=CONV_LAYERS, conv_bias=True, packed=True)
    return check_cp("lfm2", tp=2, plan="auto", layer_types=CONV_LAYERS, conv_bias=True)


@pytest.mark.parametrize("dims", ["cp4", "cp2xtp2", "cp2xpp2"])
def test_short_convolutions_at_cp4_and_with_tp(ranks, dims):
    results = ranks(4).run(check_short_convolutions_at, dims, timeout=TIMEOUT_S)
    assert len(results) == 4 and all(isinstance(r, (str, list)) for r in results), results


def check_delta_rule():
    """Gated delta-rule hybrids (three linear-attention layers, one attention layer): each chunk's
    recurrence run from the state its earlier chunks leave, its short convolution with halos."""
    return {"qwen3_5_text packed": check_cp("qwen3_5_text", packed=True),
            "qwen3_next contiguous all-gather": check_cp("qwen3_next", mode="all-gather", layout="contiguous"),
            "olmo_hybrid": check_cp("olmo_hybrid"),
            "lara_mini (sliding layers too)": check_cp("lara_mini", sliding_window=3),
            "kimi_linear (delta attention)": check_cp("kimi_linear", packed=True),
            "bailing_hybrid (delta attention)": check_cp("bailing_hybrid")}


def test_cp2_gated_delta_rule_hybrids(ranks):
    results = ranks(2).run(check_delta_rule, timeout=TIMEOUT_S)
    assert all(len(r) == 6 for r in results), results


def check_delta_rule_at(dims: str):
    if dims == "cp4":  # eight chunks of 2 tokens: states composed over up to seven chunks, halos over two
        return check_cp("qwen3_5_text", cp=4)
    if dims == "cp2xtp2":
        return check_cp("qwen3_5_text", tp=2)
    return check_cp("qwen3_next", pp=2, packed=True)


@pytest.mark.parametrize("dims", ["cp4", "cp2xtp2", "cp2xpp2"])
def test_gated_delta_rule_at_cp4_and_with_tp_pp(ranks, dims):
    results = ranks(4).run(check_delta_rule_at, dims, timeout=TIMEOUT_S)
    assert len(results) == 4 and all(isinstance(r, str) for r in results), results


def check_mamba2():
    """Mamba-2 mixers, each chunk's scan started from the state the earlier chunks leave: Mamba-2
    alone, Nemotron-H (Mamba, MoE, attention and MLP blocks), Bamba on packed rows, Falcon-H1 in the
    other mode and layout, Granite 4 hybrid, Zamba2 (shared attention blocks)."""
    return {"mamba2": check_cp("mamba2"),
            "nemotron_h": check_cp("nemotron_h"),
            "bamba packed": check_cp("bamba", packed=True),
            "falcon_h1 contiguous all-gather": check_cp("falcon_h1", mode="all-gather", layout="contiguous"),
            "granitemoehybrid": check_cp("granitemoehybrid"),
            "zamba2": check_cp("zamba2", plan="auto")}


def test_cp2_mamba2_hybrids(ranks):
    results = ranks(2).run(check_mamba2, timeout=TIMEOUT_S)
    assert all(len(r) == 6 for r in results), results


def check_mamba2_at(dims: str):
    if dims == "cp4":  # eight chunks of 2 tokens
        return check_cp("mamba2", cp=4)
    return check_cp("nemotron_h", pp=2, plan="auto")


@pytest.mark.parametrize("dims", ["cp4", "cp2xpp2"])
def test_mamba2_at_cp4_and_with_pp(ranks, dims):
    results = ranks(4).run(check_mamba2_at, dims, timeout=TIMEOUT_S)
    assert len(results) == 4 and all(isinstance(r, str) for r in results), results


def check_elementwise_recurrences():
    """Mamba-1 mixers (selective scans) and Griffin's RG-LRU, each chunk continued from the state the
    earlier chunks leave: Mamba, Falcon-Mamba (norms on B, C and dt) in the other mode and layout,
    Jamba (Mamba, attention and MoE layers) on packed rows, Zamba (multi-head Mamba mixers, shared
    attention blocks), RecurrentGemma (recurrent blocks with a
    short convolution, local attention) alone and on packed rows (its state reset where a sequence
    starts). RecurrentGemma's scan accumulates in float32 whatever the model's dtype: a float32 model,
    compared at float32's tolerance. RWKV (its WKV ratio run twice per chunk: from zero for its state,
    then from the composed state entering it; its token shifts with a halo of one): starting every
    chunk from zero, or dropping the halo, fails it. xLSTM's mLSTM likewise (its matrix memory,
    normalizer and running max composed across chunks); starting every chunk empty fails it."""
    done = {"mamba": check_cp("mamba"),
            "falcon_mamba contiguous all-gather": check_cp("falcon_mamba", mode="all-gather", layout="contiguous"),
            "jamba packed": check_cp("jamba", packed=True),
            "zamba (a scan per Mamba head)": check_cp("zamba", plan="auto"),
            "recurrent_gemma": check_cp("recurrent_gemma", plan="auto", dtype=torch.float32),
            "recurrent_gemma packed": check_cp("recurrent_gemma", plan="auto", dtype=torch.float32, packed=True),
            "rwkv contiguous": check_cp("rwkv", plan="auto", layout="contiguous"),
            "xlstm all-gather": check_cp("xlstm", plan="auto", mode="all-gather")}
    # xLSTM's training kernel runs whole chunks of its chunk_size: pieces of 4 tokens take chunks of 2,
    # and refuse chunks of 8 naming the length that would serve ("mode" is cp's keyword: config=).
    done["xlstm training kernel"] = check_cp("xlstm", plan="auto", config=dict(mode="train"), chunk_size=2)
    with pytest.raises(ValueError, match=r"chunks of 8 tokens, but each of this rank's 2 pieces of the sequence "
                                         r"holds 4: use a sequence length divisible by 32"):
        check_cp("xlstm", plan="auto", config=dict(mode="train"), chunk_size=8)
    return done


def test_cp2_mamba1_griffin_rwkv_and_xlstm_models(ranks):
    results = ranks(2).run(check_elementwise_recurrences, timeout=TIMEOUT_S)
    assert all(len(r) == 9 for r in results), results


def check_lightning_attention():
    """MiniMax's lightning attention (linear attention, one decay per head, alternating with softmax
    attention layers): the layer's own block loop corrected by the states entering each chunk; blocks
    of 3 and 5 tokens straddle the chunks of 2 and 4."""
    return {"minimax": check_cp("minimax"),
            "minimax blocks of 3, packed": check_cp("minimax", block_size=3, packed=True),
            "minimax blocks of 5, contiguous all-gather": check_cp("minimax", block_size=5, mode="all-gather",
                                                                   layout="contiguous")}


def test_cp2_lightning_attention(ranks):
    results = ranks(2).run(check_lightning_attention, timeout=TIMEOUT_S)
    assert all(len(r) == 3 for r in results), results


def check_recurrences_at(dims: str):
    griffin = dict(plan="auto", dtype=torch.float32)
    if dims == "cp4":  # eight chunks of 2 tokens
        return [check_cp("mamba", cp=4), check_cp("recurrent_gemma", cp=4, **griffin),
                check_cp("minimax", cp=4, block_size=3), check_cp("rwkv", cp=4, plan="auto"),
                check_cp("xlstm", cp=4, plan="auto")]
    if dims == "cp2xtp2":  # each tensor-parallel rank scans its own channels
        return [check_cp("mamba", tp=2), check_cp("recurrent_gemma", tp=2, **griffin), check_cp("minimax", tp=2)]
    return [check_cp("jamba", pp=2, schedule="1f1b", plan="auto"), check_cp("minimax", pp=2)]


@pytest.mark.parametrize("dims", ["cp4", "cp2xtp2", "cp2xpp2"])
def test_mamba1_griffin_lightning_at_cp4_and_with_tp_pp(ranks, dims):
    results = ranks(4).run(check_recurrences_at, dims, timeout=TIMEOUT_S)
    assert len(results) == 4 and all("grads on this rank" in r for done in results for r in done), results


def check_experts_over_cp():
    """Expert parallelism over the cp ranks (ep=2 inside dp x cp = 1 x 2): each rank dispatches its
    shard's tokens to both ranks' experts."""
    return {"qwen2_moe packed": check_cp("qwen2_moe", ep=2, packed=True),
            "gpt_oss": check_cp("gpt_oss", ep=2, sliding_window=3)}


def test_cp2_with_experts_split_over_cp(ranks):
    results = ranks(2).run(check_experts_over_cp, timeout=TIMEOUT_S)
    assert all(len(r) == 2 for r in results), results


def check_sinks_with(dim: str):
    if dim == "tp":  # the sinks split with their heads
        return check_cp("gpt_oss", sliding_window=3, tp=2)
    return check_cp("gpt_oss", sliding_window=3, pp=2, schedule="zb-h1")


@pytest.mark.parametrize("dim", ["tp", "pp"])
def test_cp2_gpt_oss_with_tp2_or_pp2(ranks, dim):
    results = ranks(4).run(check_sinks_with, dim, timeout=TIMEOUT_S)
    assert all("grads on this rank" in r for r in results), results


def test_cp_errors_name_the_values(ranks):
    assert ranks(2).run(check_errors, timeout=TIMEOUT_S) == [True, True]


def check_segments_agree():
    """A boundary in rank 0's chunks only (zigzag: rank 0 holds chunks 0 and 3, rank 1 chunks 1
    and 2): rank 1's tokens all lie in one sequence, yet both ranks pass segment ids to the op,
    which exchanges them with the keys and values (a rank passing none used to hang both)."""
    from torchpp.context_parallel.hf import ContextParallel, _segment_ids

    state = torchpp.init_parallel(cp=2)
    cp = ContextParallel(state.cp_group)
    packed = torch.arange(16).unsqueeze(0)
    packed[:, 2:] -= 2  # one document of 2 tokens, then one of 14
    local = cp.shard(packed)
    starts = cp.positions(16, local.device) - local
    alone = bool((starts == starts[..., :1]).all())
    segments = _segment_ids(cp, local, local.size(1))
    plain = _segment_ids(cp, cp.shard(torch.arange(16).unsqueeze(0)), local.size(1))
    return alone, segments is not None, plain is None


def test_cp_ranks_agree_on_packed_segments(ranks):
    results = ranks(2).run(check_segments_agree, timeout=TIMEOUT_S)
    assert [alone for alone, _, _ in results] == [False, True], results  # the case: rank 1 alone sees one sequence
    assert all(passed and plain for _, passed, plain in results), results
