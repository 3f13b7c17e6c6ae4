"""Transformer shapes the planner reasons about: presets and Hugging Face config.json files."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer: L layers of width h with a heads over a vocabulary of V."""

    name: str
    num_layers: int
    hidden: int
    heads: int
    vocab: int
    ffn_hidden: int = 0  # 0: 4h
    kv_heads: int = 0  # 0: heads (no GQA)
    gated_mlp: bool = False  # SwiGLU-style MLP: three matrices instead of two
    tied_embeddings: bool = True

    @property
    def ffn(self) -> int:
        return self.ffn_hidden or 4 * self.hidden

    @property
    def layer_parameters(self) -> int:
        h, kv = self.hidden, (self.kv_heads or self.heads)
        kv_width = h * kv // self.heads
        attention = 2 * h * h + 2 * h * kv_width
        mlp = (3 if self.gated_mlp else 2) * h * self.ffn
        return attention + mlp + 4 * h  # + two LayerNorms' weight and bias

    @property
    def embedding_parameters(self) -> int:
        return self.vocab * self.hidden

    @property
    def num_parameters(self) -> int:
        head = 0 if self.tied_embeddings else self.embedding_parameters
        return self.num_layers * self.layer_parameters + self.embedding_parameters + head


PRESETS = {
    config.name: config
    for config in (
        ModelConfig("gpt3-175b", num_layers=96, hidden=12288, heads=96, vocab=51200),
        ModelConfig("gpt-13b", num_layers=40, hidden=5120, heads=40, vocab=51200),
        ModelConfig("gpt-1.3b", num_layers=24, hidden=2048, heads=16, vocab=51200),
        ModelConfig("gpt2-small", num_layers=12, hidden=768, heads=12, vocab=50257),
        ModelConfig("llama2-7b", num_layers=32, hidden=4096, heads=32, vocab=32000, ffn_hidden=11008,
                    gated_mlp=True, tied_embeddings=False),
        ModelConfig("tiny", num_layers=8, hidden=256, heads=8, vocab=1024),
    )
}


def load_model_config(spec: str) -> ModelConfig:
    """A preset name or the path of a transformers config.json (GPT-2 or Llama-family keys)."""
    if spec in PRESETS:
        return PRESETS[spec]
    if not os.path.exists(spec):
        raise ValueError(f"--model {spec!r} is neither a preset ({', '.join(PRESETS)}) nor a config.json file")
    with open(spec) as f:
        raw = json.load(f)

    def pick(*keys, default=None):
        for key in keys:
            if raw.get(key) is not None:
                return raw[key]
        if default is None:
            raise ValueError(f"{spec}: none of the keys {keys} is set")
        return default

    hidden = pick("hidden_size", "n_embd", "d_model")
    gated = raw.get("model_type") in ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "mixtral")
    return ModelConfig(
        name=raw.get("_name_or_path") or raw.get("model_type") or os.path.basename(spec),
        num_layers=pick("num_hidden_layers", "n_layer", "num_layers"),
        hidden=hidden,
        heads=pick("num_attention_heads", "n_head"),
        vocab=pick("vocab_size"),
        ffn_hidden=pick("intermediate_size", "n_inner", "ffn_dim", default=0) or 0,
        kv_heads=pick("num_key_value_heads", default=0) or 0,
        gated_mlp=gated,
        tied_embeddings=bool(raw.get("tie_word_embeddings", True)),
    )
