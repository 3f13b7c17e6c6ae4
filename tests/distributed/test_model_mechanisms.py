"""The mechanisms behind the transformers types that once failed to wrap, each on a small family
that shows it, and the flagship families (Gemma 4 and Gemma 4 unified, DeepSeek-V4, Mistral Large 4)
at tp=2 and at pp=2 under zb-h1 and interleaved-1f1b. All on 2 gloo ranks in float64 against the unwrapped
model (torchpp.testing.model_checks: loss, logits, every gradient, one SGD step).

Pipeline (pp=2):
- modules run in another order than registered (T5Gemma's final norm registered before the
  layers, Phi-4's embedding after them), found by a traced forward (torchpp.models.run_order);
- a tied input and output embedding in an encoder-decoder-shaped model (T5Gemma 2's text model: its
  final norm registered before the layers), its gradients summed between first and last stage;
- trainable modules every stage runs (Gemma 3n's per-layer embeddings): kept on every pipeline
  rank, their gradients summed over the pipeline; and what layers leave in a shared mapping for
  later layers (its shared key/value states) travels to the next stage;
- layers that read the token ids (Higgs audio's audio-token masks): the ids travel along;
- layers returning more than the hidden states (GLM-MoE-DSA's top-k indices): it travels along;
- tied parameters listed head first, one of them tied inside the head alone (CamemBERT's bias):
  the end stages sum the same ones (read before the cut), and ranks that would sum different
  ones fail clearly on every rank instead of killing one inside the collective;
- plan="auto" at tp=1 reads only the stack (Zamba 2: Mamba and hybrid layers, one linear the TP
  rule cannot decide);
- a block layers on several pipeline ranks share (Zamba's attention, tied from its first hybrid
  layer to the others): its gradients summed over the pipeline; so are those of parameters the
  base model holds itself (Zaya's input scale and bias, which no placeholder replaces);
- a head wider than config.vocab_size (Inkling 2's head is unpadded_vocab_size wide): the
  pipeline's loss takes every logit, as the model's own does; and a tensor the forward builds
  between the layers from the hidden states entering a stage (Inkling 2's block states, a block
  boundary at the cut): the placeholder of the layer before the stage returns what it received.
Tensor parallelism (tp=2):
- per-layer configs (transformers' heterogeneous configs): head counts read per layer;
- statistics across a split width (ESMC's full-width q/k norms, Gemma 3n's sparse activations):
  that group gathers (torchpp.models.split_checks); a row split nothing feeds a split input to
  (GLM-5-Next's linear-attention layers) stays whole;
- fused ``gate_up_proj`` experts split half by half, and shared experts of raw parameters
  whose inputs need their gradients summed (Inkling);
- per-head quantities of split attention (Doge's dynamic mask);
- modules transformers keeps in float32, and float32 softmax as a tensor method, inside a
  float64 comparison (Bailing hybrid, DeepSeek-OCR 2);
- plan="auto" on multi-head latent attention (DeepSeek-V3, dots3): the down projections whole, q_b
  and kv_b split by columns, o by rows; kv_a's rotary key reaches every rank's heads directly, so
  the f sits on kv_a's output and kv_b has none (its norm's gradients summed over TP): without
  either, the embedding's gradient differs (checked); with sequence parallelism too;
- plan="auto": groups whose split would fail or change the result stay whole while the rest
  splits (LFM3's short-convolution mixer whole, its attention and MLP split), fused parts a view cuts split part by part (Moshi's fc1), traced forwards leave no
  autograd history on modules (RecurrentGemma's recurrent state); a router sampling in training
  (PhiMoE) draws the same in the wrapped model as in the reference; a linear class writing nn.Linear's
  math out in its own forward (Falcon's FalconLinear) splits like nn.Linear.
"""
import pytest

from torchpp.testing.model_checks import check_pp, check_tp

TIMEOUT_S = 300


def run_checks(cases):
    done = []
    for check, model_type, options in cases:
        (check_tp if check == "tp" else check_pp)(model_type, **options)
        done.append(f"{check} {model_type} {options}")
    return done


PP_SCHEDULES = [("pp", dict(schedule="zb-h1")), ("pp", dict(schedule="interleaved-1f1b", n_microbatches=4))]
MECHANISMS = {
    "run order differs from registration": [("pp", "t5_gemma_module", {}), ("pp", "phi4_multimodal", {})],
    "tied embedding, encoder-decoder shaped": [("pp", "t5gemma2_text", {})],
    "modules every stage runs, state left for later layers": [("pp", "gemma3n_text", {})],
    "layers reading token ids": [("pp", "higgs_audio_v2", {})],
    "layers returning extra outputs": [("pp", "glm_moe_dsa", {})],
    "tied parameters listed head first": [("pp", "camembert", {"plan": "auto"})],
    "plan='auto' at tp=1 reads only the stack": [("pp", "zamba2", {"plan": "auto"})],
    "a block layers on both pipeline ranks share": [("pp", "zamba", {"plan": "auto"})],
    "parameters the base model holds itself": [("pp", "zaya", {"plan": "auto"})],
    "a head wider than the vocabulary, block states built at the cut": [
        ("pp", "inkling2_text", {"plan": "auto", "unpadded_vocab_size": 120, "n_layers_per_attn_res_block": 2})],
    "per-layer head counts": [("tp", "embedding_gemma2_text", {})],
    "statistics across a split width": [("tp", "esmc", {}), ("tp", "gemma3n_text", {}), ("tp", "glm5_next_text", {})],
    "fused and shared experts": [("tp", "inkling_text", {})],
    "per-head quantities": [("tp", "doge", {})],
    "float32 inside float64": [("tp", "bailing_hybrid", {}), ("tp", "deepseek_ocr2_text", {})],
    # plan="auto" (torchpp.models.auto_check): a mixer cut by hard-coded sizes stays whole, a view's
    # fused parts split part by part; a trace leaves no recurrent state behind.
    "auto plans tried before splitting": [("tp", "falcon_h1", {"plan": "auto"}), ("tp", "moshi", {"plan": "auto"}),
                                          ("tp", "recurrent_gemma", {"plan": "auto"})],
    "random draws in training": [("tp", "phimoe", {"plan": "auto"})],  # its router samples experts
    "low-rank projections kept whole (MLA)": [("tp", "deepseek_v3", {"plan": "auto"}),
                                              ("tp", "deepseek_v3", {"plan": "auto", "sequence_parallel": True}),
                                              ("tp", "dots3_note", {"plan": "auto"})],
    # FalconLinear writes nn.Linear's math out in its own forward: the TP forward stands in for it.
    "linears writing out their own forward": [("tp", "falcon", {"plan": "auto"})],
}
FLAGSHIPS = ("gemma4_text", "gemma4_unified_text", "deepseek_v4", "mistral_large4_text")


@pytest.mark.parametrize("mechanism", sorted(MECHANISMS))
def test_mechanism(ranks, mechanism):
    cases = MECHANISMS[mechanism]
    assert ranks(2).run(run_checks, cases, timeout=TIMEOUT_S)[0] == [f"{c} {t} {o}" for c, t, o in cases]


def _latents_under_zero_bubble():
    return check_pp("deepseek_v3", tp=2, schedule="zb-h1", n_microbatches=4, plan="auto")


@pytest.mark.timeout(TIMEOUT_S + 60)
def test_latents_split_under_a_zero_bubble_pipeline(ranks):
    # plan="auto"'s MLA at tp=2 x pp=2 under zb-h1: kv_b (no f of its own) defers its weight
    # gradient to the W pass like any split linear, and kv_a's f sums the heads' rotary-key gradients.
    assert all("grads on this rank" in d for d in ranks(4).run(_latents_under_zero_bubble, timeout=TIMEOUT_S))


@pytest.mark.parametrize("model_type", FLAGSHIPS)
def test_flagship(ranks, model_type):
    cases = [("tp", model_type, {})] + [(check, model_type, options) for check, options in PP_SCHEDULES]
    assert len(ranks(2).run(run_checks, cases, timeout=TIMEOUT_S)[0]) == 3


def _paired_heads():
    # Default tiny sizes, then lambdas as long as the heads are many (8 of 8 values): a vector the
    # trace takes for one value per head, tried split, then kept whole with its gradients summed.
    return [check_tp("diffllama", plan="auto"),
            check_tp("diffllama", plan="auto", num_attention_heads=8, num_key_value_heads=8, head_dim=8)]


def test_auto_plan_splits_differential_attention_by_pairs(ranks):
    # DiffLlama pairs query head j with j + H/2 (and value halves likewise): q, k and v split half by
    # half (packed_colwise), o by rows; its lambdas, parameters of the attention module that also
    # holds the split linears, stay whole with their gradients summed over TP. Before, that module's
    # gradient sum also summed its split linears' shards (q_proj's gradient 2x off at tp=2).
    details = ranks(2).run(_paired_heads, timeout=TIMEOUT_S)
    assert all(d.endswith("DiffLlamaDecoderLayer 7/7") for rank in details for d in rank), details


def _experts_in_one_weight():
    return [check_tp("jetmoe", plan="auto"), check_tp("jetmoe", plan="auto", sequence_parallel=True)]


def test_auto_plan_splits_experts_linears_held_in_one_weight(ranks):
    # JetMoE's experts (JetMoeParallelExperts, weight [experts, out, in]) in its MoE and in its mixture
    # of attention heads: input_linear by columns (the MoE's fused gate|up part by part), output_linear
    # by rows, kv_proj's k|v part by part; the attention mixture builds its query width from
    # hidden_size, found by the split trial and divided (local_widths). Routers stay whole.
    details = ranks(2).run(_experts_in_one_weight, timeout=TIMEOUT_S)
    assert all(d.endswith("JetMoeDecoderLayer 5/7") for rank in details for d in rank), details


def _partly_split():
    return check_tp("lfm3", plan="auto")


def test_auto_plan_splits_around_what_it_keeps_whole(ranks):
    # LFM3's short-convolution mixer (in_proj's output mixed by a depthwise conv over its whole
    # width, which the split trial finds) stays whole in its two conv layers; the attention and MLPs
    # split (3 of 8 linears there, 8 of 8 elsewhere: weights smaller than the unwrapped model's);
    # loss, logits, every gradient and one SGD step still match.
    details = ranks(2).run(_partly_split, timeout=TIMEOUT_S)
    assert all(d.endswith("linears split per layer: Lfm3DecoderLayer 3-8/8") for d in details), details


def _sum_different_parameters():
    import torch.distributed as dist
    from torch import nn

    from torchpp.models.passes.schedule import _check_same_shapes

    model = nn.Linear(3, 2 + dist.get_rank())  # each rank's weight has another shape
    try:
        _check_same_shapes(model, [model.weight], dist.group.WORLD)
    except RuntimeError as error:
        return str(error)
    return "no error"


def test_ranks_summing_different_parameters_fail_clearly(ranks):
    messages = ranks(2).run(_sum_different_parameters, timeout=60)
    assert all("disagree on the parameters" in m and "rank 1: [('weight', (3, 3))]" in m for m in messages), messages
