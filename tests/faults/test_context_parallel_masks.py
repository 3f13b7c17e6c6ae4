"""What context parallelism used to get silently wrong, each against the unwrapped model in float64
(torchpp.testing.model_checks.check_cp) at cp=2 on gloo:

- Llama 4's chunked-attention layers (a token sees the earlier tokens of its chunk of
  attention_chunk_size) are built by transformers' mask alone, which sharded attention does not
  use: they attended to every earlier token (logits off by 0.65 here). The chunks are now segment ids.
- Llama 4's and GPT-BigCode's attention modules are not given the position ids, from which packed
  rows' sequences are told apart: their tokens attended across sequences (off by 0.64 and 0.07).
  The position ids the layer was called with are used.
- Bloom computes attention in its own code (ALiBi), never calling the attention function sharded
  attention replaces: each rank attended within its own shard (off by 0.02). It was refused (as
  OpenAI GPT still is); Bloom's, MPT's, Falcon's and GPT-Neo's are now routed to sharded attention.
- Layers that mix the sequence without attention (MiniMax's linear attention, LFM2's short
  convolutions, RecurrentGemma's recurrence) ran on each rank's shard alone (off by 0.06, 0.0008,
  0.16): a layer of the stack that makes no attention call now raises at its first forward, naming
  it (here a running mean put in a Llama layer), and a convolution over the sequence inside a layer
  is refused when the model is wrapped. All three have since been sharded
  (``torchpp.context_parallel.halo``: each chunk run with the tokens before it from their ranks;
  ``rg_lru`` and ``lightning``: the recurrence's state carried across chunks;
  tests/distributed/test_context_parallel_models.py).
- RoBERTa-style embeddings count positions from padding_idx + 1, derived from the tokens; the
  global positions sharding gives them were 2 off (camembert, roberta, xlm-roberta, xmod: off by
  0.4-0.6). They were refused, and are now given the positions their rule derives from the whole
  sequence (``context_parallel.positions``).
- Zaya's attention convolves its queries and keys over the sequence before attending: the
  convolution read zeros across each shard's edge (off by 0.04). A convolution over the sequence
  inside a layer is now refused.
- Models that do not declare attention backends are served when they route attention through
  transformers' functions and take position ids (StableLM, BioGPT). Among them Inkling passes a
  relative position bias to its attention function as a keyword, which sharded attention ignored
  (off by 8e-6 here): a tensor keyword the op does not read is now refused, naming it. BART's
  decoders count positions from their input's length: each rank's from 0 (refused, then served
  with the whole sequence's); their loss is the mean of their own per-token losses, which a
  shard's mean weighs wrongly (now computed over the batch); BigBirdPegasus's decoder declares
  is_causal=False and relied on its mask alone: its attention ran bidirectional (off by 0.19;
  a decoder's self-attention is now causal). Packed rows, which those models' masks do not split,
  are refused for the decoders that count from the length.
- GPT-OSS's, OPT's, AfMoE's and BioGPT's forwards hand their mask functions no position ids, so
  their masks do not split packed rows (transformers splits them by the position ids it is given):
  sharded attention split them, and their documents stopped seeing each other (off by 0.35, 0.30,
  0.76, 0.18). The model's calls to its mask functions are now watched
  (``context_parallel.mask_calls``): rows are split only where one got position ids.

- OpenAI GPT's activations are module instances every model of the type shares: wrapping one
  model tagged them with its cp group, and the next model could not be copied. Only modules
  with weights are tagged now.

And what hung or split at cp x pp: a CP refusal raised only on the pipeline stage holding the
offending layer (the others went on into the next collective), positions and carried outputs
decided by one stage alone (RoBERTa, MPT), and tied embeddings at cp x pp (the two end stages' group left cp
out, so their shape check's collective differed in groups and waited forever)."""
import pytest
import torch
from torch import nn

import torchpp
from torchpp.models import parallelize
from torchpp.testing.model_checks import check_cp
from torchpp.testing.tiny_models import tiny_model

TIMEOUT_S = 300


def _silent_before():
    # BART's inline per-token loss (a shard's mean weighed wrongly) and BigBirdPegasus's decoder
    # (is_causal=False, causal by its mask alone) were wrong once served.
    return [check_cp("llama4_text", attention_chunk_size=4), check_cp("llama4_text", packed=True),
            check_cp("gpt_bigcode", packed=True, plan="auto"), check_cp("bart", plan="auto"),
            check_cp("bigbird_pegasus", plan="auto")]


def test_chunked_layers_and_packed_rows_without_position_ids(ranks):
    for done in ranks(2).run(_silent_before, timeout=TIMEOUT_S):
        assert all("grads on this rank" in d for d in done), done


def _masks_blind_to_packing():
    return [check_cp("gpt_oss", sliding_window=3, packed=True, mode="all-to-all"),
            check_cp("opt", packed=True, plan="auto"), check_cp("afmoe", packed=True),
            check_cp("biogpt", packed=True, plan="auto")]


def test_packed_rows_stay_whole_where_the_model_masks_do_not_split_them(ranks):
    for done in ranks(2).run(_masks_blind_to_packing, timeout=TIMEOUT_S):
        assert all("grads on this rank" in d for d in done), done


def _own_attention_code():
    state = torchpp.init_parallel(cp=2)
    # (Bloom's, the case first met, and RoFormer's are routed since: own_attention.py.)
    with pytest.raises(NotImplementedError, match="XLNetLMHeadModel does not run its attention through "
                                                  "transformers' attention functions"):
        parallelize(tiny_model("xlnet"), state=state, plan="auto")
    return "refused"


def test_a_model_computing_attention_itself_is_refused(ranks):
    assert ranks(2).run(_own_attention_code, timeout=TIMEOUT_S) == ["refused"] * 2


def _two_models_sharing_modules():
    # OpenAI GPT's activations are module instances shared by every model of the type: wrapping one
    # model under cp tagged them with its group, and the next model could not be copied (pickling a
    # ProcessGroup). Only modules with weights are tagged now.
    return [check_cp("openai-gpt", plan="auto"), check_cp("openai-gpt", plan="auto", packed=True)]


def test_a_second_model_wraps_after_one_that_shares_its_modules(ranks):
    done = ranks(2).run(_two_models_sharing_modules, timeout=TIMEOUT_S)
    assert all(len(d) == 2 and all("grads on this rank" in r for r in d) for d in done), done


class RunningMean(nn.Module):
    """Mixes the sequence without calling attention: each token becomes the mean of the tokens up to it."""

    def forward(self, hidden_states, *args, **kwargs):
        counts = torch.arange(1, hidden_states.size(1) + 1, dtype=hidden_states.dtype)[:, None]
        return hidden_states.cumsum(1) / counts, None


def llama_with_a_convolution():
    """A Llama whose layer 0 attention holds a convolution over the sequence torchpp does not know
    (ZAYA's are served, with halos)."""
    model = tiny_model("llama")
    model.model.layers[0].self_attn.smoother = nn.Conv1d(8, 8, kernel_size=3, groups=8)
    return model


def _layers_without_attention():
    model = tiny_model("llama")
    model.model.layers[1].self_attn = RunningMean()
    wrapped = parallelize(model, state=torchpp.init_parallel(cp=2))
    with pytest.raises(NotImplementedError, match=r"layer model\.layers\.1 \(LlamaDecoderLayer\) ran without calling "
                                                  r"attention"):
        wrapped(input_ids=torch.zeros(2, 16, dtype=torch.long))
    with pytest.raises(NotImplementedError, match=r"model\.layers\.0\.self_attn\.smoother convolves over the sequence "
                                                  r"\(kernel 3\)"):
        parallelize(llama_with_a_convolution(), state=torchpp.init_parallel(cp=2))
    # A tensor the attention function is handed that the op does not read (a bias of the caller's own):
    # layer 0 calls attention before layer 1 runs.
    with pytest.raises(NotImplementedError, match=r"LlamaAttention passes score_bias to its attention function"):
        wrapped(input_ids=torch.zeros(2, 16, dtype=torch.long), score_bias=torch.zeros(2, 4, 8, 16))
    # A mask an attention module makes itself (Doge's is served: tests/distributed/test_context_parallel_models.py).
    own_mask = parallelize(tiny_model("llama"), state=torchpp.init_parallel(cp=2))
    own_mask.model.layers[0].self_attn.register_forward_pre_hook(
        lambda module, args, kwargs: (args, {**kwargs, "attention_mask": torch.zeros(2, 1, 8, 8)}), with_kwargs=True)
    with pytest.raises(NotImplementedError, match=r"LlamaAttention is given an attention mask it built itself "
                                                  r"\(Tensor \(2, 1, 8, 8\)\)"):
        own_mask(input_ids=torch.zeros(2, 16, dtype=torch.long))
    with pytest.raises(ValueError, match=r"WhisperForCausalLM counts its positions from its input's length"):
        check_cp("whisper", plan="auto", packed=True)
    return "refused"


def test_layers_mixing_the_sequence_otherwise_and_unread_biases_are_refused(ranks):
    assert ranks(2).run(_layers_without_attention, timeout=TIMEOUT_S) == ["refused"] * 2


def _decided_on_the_whole_model_at_cp_and_pp():
    # Stage 1 holds no convolving layer: the refusal is decided on the whole model, before the pipeline
    # cut, so every rank raises it (stage 0 alone raising left the others in the next collective).
    with pytest.raises(NotImplementedError, match=r"model\.layers\.0\.self_attn\.smoother convolves over the sequence"):
        parallelize(llama_with_a_convolution(), state=torchpp.init_parallel(cp=2, pp=2), n_microbatches=2)
    # Stage 1 holds no position embeddings: decided there alone, RoBERTa's positions (padding tokens
    # among them) split its rows as if packed (loss off by 1.2e-4). MPT's stage 0 handed on no
    # attention weights where its traced layout expected them (stage 1 misread what it received).
    return [check_cp("roberta", pp=2, plan="auto"), check_cp("mpt", pp=2, plan="auto", dtype=torch.float32)]


def test_what_cp2_x_pp2_decides_is_decided_alike_on_every_rank(ranks):
    done = ranks(4).run(_decided_on_the_whole_model_at_cp_and_pp, timeout=TIMEOUT_S)
    assert len(done) == 4 and all(len(d) == 2 for d in done), done


def _tied_embeddings_at_cp_and_pp():
    # Gemma ties its output head to its embedding: the end stages' group spans dp x cp x tp.
    return check_cp("gemma", pp=2, schedule="1f1b")


def test_tied_embeddings_at_cp2_x_pp2_train_as_unsharded(ranks):
    done = ranks(4).run(_tied_embeddings_at_cp_and_pp, timeout=TIMEOUT_S)
    assert all("grads on this rank" in d for d in done), done
