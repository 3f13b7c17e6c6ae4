"""Tiny random transformers models (no downloads) and comparisons of wrapped vs unwrapped."""
import torch
from transformers import (
    Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig, GemmaConfig, GemmaForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, MistralConfig,
    MistralForCausalLM, MixtralConfig, MixtralForCausalLM, Phi3Config, Phi3ForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM,
)

from tp_reference import assert_close

SEQ, BATCH = 8, 4


def tiny_model(kind: str, *, dropout: float = 0.0, num_layers: int = 4, tied=None, kv_heads: int = 2):
    """The same random model on every rank (fixed seed). Vocabularies of Mistral and GPT-2 are
    odd, so tp=2 exercises vocabulary padding; Mistral's window is shorter than SEQ, and so is
    Qwen2's, which only its upper half of the layers use (the rest attend to everything). Qwen3's
    heads are wider than hidden / heads, and its per-head q/k norm weights are random, not ones.
    Gemma scales its embeddings by sqrt(hidden); its token 0 is padding (no gradient). Gemma 2 adds
    norms after attention and MLP, a window on alternate layers and tanh caps on attention scores
    and logits, low enough (and q/k weights large enough) that the caps bite. Gemma 3 rotates its
    alternating window and full layers by tables of far-apart bases, and has q/k norms. Phi-3 fuses
    q, k and v (GQA: k and v narrower than q) and gate and up into one projection each, and its
    rotary covers half of each head. ``kv_heads``: key/value heads of the 4 query heads (not GPT-2)."""
    torch.manual_seed(1234)
    if kind == "llama":
        config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers,
                             num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=64,
                             attention_bias=True, attention_dropout=dropout,
                             tie_word_embeddings=bool(tied))
        model = LlamaForCausalLM(config)
    elif kind == "mistral":
        config = MistralConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers,
                               num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=64,
                               sliding_window=5, attention_dropout=dropout, tie_word_embeddings=bool(tied))
        model = MistralForCausalLM(config)
    elif kind == "mixtral":  # 4 experts, 2 per token
        config = MixtralConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=num_layers,
                               num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=64,
                               num_local_experts=4, num_experts_per_tok=2, attention_dropout=dropout,
                               tie_word_embeddings=bool(tied))
        model = MixtralForCausalLM(config)
    elif kind == "qwen2":
        config = Qwen2Config(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers,
                             num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=64,
                             use_sliding_window=True, sliding_window=5, max_window_layers=num_layers // 2,
                             attention_dropout=dropout, tie_word_embeddings=bool(tied))
        model = Qwen2ForCausalLM(config)
    elif kind == "qwen3":
        config = Qwen3Config(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers,
                             num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=16, max_position_embeddings=64,
                             attention_dropout=dropout, tie_word_embeddings=bool(tied))
        model = Qwen3ForCausalLM(config)
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
                layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    elif kind == "gemma":
        config = GemmaConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers,
                             num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=8, max_position_embeddings=64,
                             attention_dropout=dropout, tie_word_embeddings=True if tied is None else tied)
        model = GemmaForCausalLM(config)
    elif kind == "gemma2":
        config = Gemma2Config(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers,
                              num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=8, max_position_embeddings=64,
                              sliding_window=5, query_pre_attn_scalar=8, attn_logit_softcapping=1.0,
                              final_logit_softcapping=1.0, attention_dropout=dropout,
                              tie_word_embeddings=True if tied is None else tied)
        model = Gemma2ForCausalLM(config)
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_proj.weight.mul_(8)
                layer.self_attn.k_proj.weight.mul_(8)
    elif kind == "gemma3":
        config = Gemma3TextConfig(
            vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers, num_attention_heads=4,
            num_key_value_heads=kv_heads, head_dim=8, max_position_embeddings=64, sliding_window=5, query_pre_attn_scalar=8,
            layer_types=["sliding_attention", "full_attention"] * (num_layers // 2),
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                             "full_attention": {"rope_type": "default", "rope_theta": 10000.0}},
            attention_dropout=dropout, tie_word_embeddings=True if tied is None else tied)
        model = Gemma3ForCausalLM(config)
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.uniform_(-0.5, 0.5)
                layer.self_attn.k_norm.weight.uniform_(-0.5, 0.5)
    elif kind == "phi3":
        config = Phi3Config(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=num_layers,
                            num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=64,
                            partial_rotary_factor=0.5, sliding_window=None, pad_token_id=3, bos_token_id=1,
                            eos_token_id=2, attention_dropout=dropout, resid_pdrop=dropout,
                            tie_word_embeddings=bool(tied))
        model = Phi3ForCausalLM(config)
    elif kind == "gpt2":
        config = GPT2Config(vocab_size=61, n_embd=32, n_layer=num_layers, n_head=4, n_positions=64,
                            attn_pdrop=dropout, resid_pdrop=dropout, embd_pdrop=dropout,
                            tie_word_embeddings=True if tied is None else tied)
        model = GPT2LMHeadModel(config)
    else:
        raise ValueError(kind)
    return model.train()


def batch(vocab: int, seed: int = 7):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, vocab, (BATCH, SEQ), generator=g)
    labels[0, 2] = -100  # an ignored label, as HF's loss allows
    return ids, labels


def padded_batch(vocab: int, seed: int = 7):
    """A batch with padding: row 1 padded on the right, row 2 on the left (its first queries
    see no key at all), padding labelled -100; (ids, labels, attention_mask)."""
    ids, labels = batch(vocab, seed)
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0
    mask[2, :2] = 0
    labels = labels.masked_fill(mask == 0, -100)
    return ids, labels, mask


def packed_batch(vocab: int, seed: int = 7):
    """Packed sequences: position ids that restart within a row (row 0 holds sequences of 3 and
    5 tokens, row 2 of 2, 3 and 3), and row 3 a continuation (positions 3..10, one sequence);
    (ids, labels, position_ids)."""
    ids, labels = batch(vocab, seed)
    positions = torch.arange(SEQ).repeat(BATCH, 1)
    positions[0] = torch.tensor([0, 1, 2, 0, 1, 2, 3, 4])
    positions[2] = torch.tensor([0, 1, 0, 1, 2, 0, 1, 2])
    positions[3] += 3
    return ids, labels, positions


def inputs_of(kind: str, vocab: int):
    """(ids, labels, attention_mask, position_ids) of a batch kind: "plain", "padded" (see
    padded_batch), "packed" (see packed_batch), or "padded_positions" (padded, with positions
    counting real tokens only, as generation code makes them for left padding)."""
    if kind == "packed":
        ids, labels, positions = packed_batch(vocab)
        return ids, labels, None, positions
    if kind in ("padded", "padded_positions"):
        ids, labels, mask = padded_batch(vocab)
        positions = (mask.cumsum(-1) - 1).clamp(min=0) if kind == "padded_positions" else None
        return ids, labels, mask, positions
    return (*batch(vocab), None, None)


def reference_step(model, ids, labels, attention_mask=None, position_ids=None):
    """Unwrapped forward/backward: (logits, loss, {hf name: grad}) incl. tied aliases. Without a
    cache, as in training: transformers then reads packed sequences from position_ids."""
    out = model(input_ids=ids, labels=labels, attention_mask=attention_mask, position_ids=position_ids,
                use_cache=False)
    out.loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters(remove_duplicate=False)}
    return out.logits.detach(), out.loss.detach(), grads


def assert_grads_match(wrapped_grads, reference_grads, what):
    assert wrapped_grads, f"{what}: no gradients to compare"
    for name, grad in wrapped_grads.items():
        assert name in reference_grads, f"{what}: {name} is not a parameter of the HF model"
        assert_close(grad, reference_grads[name], f"{what} grad of {name}")


def check_wrapped_step(wrapped, ids, labels, ref_loss, ref_grads, what, attention_mask=None, position_ids=None):
    """An eval_step, then one step of a parallelized model: both losses (on the last stage) and
    every local gradient equal the reference's, and eval_step leaves no gradient behind;
    returns the HF names this rank holds gradients for."""
    loss = wrapped.eval_step(ids, labels, attention_mask=attention_mask, position_ids=position_ids)
    assert all(p.grad is None for p in wrapped.parameters()), f"{what}: eval_step produced gradients"
    if wrapped.has_last_stage:
        assert_close(loss, ref_loss, f"{what} eval loss")
    else:
        assert loss is None
    loss = wrapped.step(ids, labels, attention_mask=attention_mask, position_ids=position_ids)
    if wrapped.has_last_stage:
        assert_close(loss, ref_loss, f"{what} loss")
    else:
        assert loss is None
    grads = wrapped.hf_state_dict(grads=True)
    assert_grads_match(grads, ref_grads, what)
    return sorted(grads)


def hf_names(model):
    return set(dict(model.named_parameters(remove_duplicate=False)))
