"""Tiny random transformers models of any model type, for tests and the model sweep.

``tiny_config(model_type)`` shrinks the type's default config (transformers' ``AutoConfig.for_model``)
to a few layers of a few heads: sizes, expert counts, MLA ranks and per-layer lists, keeping
each kind of layer the type has; dropouts off; token ids inside the vocabulary. No download.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch
from torch import nn

NUM_LAYERS = 4
# Model types a tiny text model cannot be built for, and why (the sweep prints the reason).
UNBUILDABLE: dict = {}
# Attribute -> tiny value, applied where the config has the attribute.
SIZES = {
    "hidden_size": 64, "n_embd": 64, "d_model": 64, "embedding_dim": 64,
    "intermediate_size": 96, "ffn_hidden_size": 96, "n_inner": 96, "dense_intermediate_size": 96,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "shared_experts_intermediate_size": 32,
    "expert_ffn_hidden_size": 32, "moe_hidden_size": 32, "share_expert_dim": 32, "shared_intermediate_size": 32,
    "num_attention_heads": 4, "n_head": 4, "num_heads": 4, "num_key_value_heads": 2, "num_kv_heads": 2,
    "head_dim": 16, "swa_head_dim": 16, "attention_head_dim": 16,
    "vocab_size": 97, "max_position_embeddings": 128, "n_positions": 128, "n_ctx": 128,
    "num_experts": 4, "n_routed_experts": 4, "num_local_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "moe_topk": 2, "top_k": 2, "moe_k": 2,
    "n_group": 1, "topk_group": 1, "num_expert_group": 1, "n_shared_experts": 1, "num_shared_experts": 1,
    "kv_lora_rank": 16, "q_lora_rank": 24, "o_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8,
    "v_head_dim": 16, "qk_head_dim": 16, "index_head_dim": 16, "index_n_heads": 2, "index_topk": 16,
    "linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_head_dim": 8, "linear_num_key_heads": 2,
    "linear_num_value_heads": 4, "linear_conv_kernel_dim": 4,
    "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": 97,
    "sliding_window": 8, "sliding_window_size": 8, "attention_window_size": 8, "max_window_layers": 2,
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "decoder_sparse_step": 1,
    "query_pre_attn_scalar": 16, "rotary_dim": 8, "partial_rotary_dim": 8,
}
DROPOUT_WORDS = ("dropout", "pdrop", "drop_rate")
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id", "mask_token_id", "image_token_id",
             "video_token_id", "audio_token_id", "boi_token_id", "eoi_token_id")


def _layer_list(values: List, n: int) -> List:
    """``values`` cut to ``n`` entries, keeping one of each distinct kind it had."""
    if len(values) <= n:
        return list(values) + list(values[-1:]) * (n - len(values))
    out = list(values[:n])
    missing = [v for v in dict.fromkeys(map(repr, values)) if v not in set(map(repr, out))]
    kinds = {repr(v): v for v in values}
    for k, kind in enumerate(missing):
        if k < n - 1:
            out[n - 1 - k] = kinds[kind]
    return out


def tiny_overrides(defaults: Dict, num_layers: int = NUM_LAYERS) -> Dict:
    """The attributes to set on a default config (``defaults``: its ``to_dict()``)."""
    out: Dict = {}
    for key, value in defaults.items():
        if key in SIZES and isinstance(value, int) and not isinstance(value, bool):
            out[key] = min(value, SIZES[key]) if key != "vocab_size" else SIZES[key]
        elif key in ("num_hidden_layers", "n_layer", "num_layers") and isinstance(value, int):
            out[key] = num_layers
        elif any(word in key for word in DROPOUT_WORDS) and isinstance(value, float):
            out[key] = 0.0
        elif isinstance(value, list) and len(value) > 1 and key.endswith(("layer_types", "_types", "_pattern",
                                                                          "layers_block_type", "_per_layer")):
            out[key] = _layer_list(value, num_layers)
        elif key in TOKEN_IDS and isinstance(value, int) and value >= SIZES["vocab_size"]:
            out[key] = SIZES["vocab_size"] - 1 - TOKEN_IDS.index(key)
        elif key in TOKEN_IDS and isinstance(value, list):
            out[key] = [v if v < SIZES["vocab_size"] else SIZES["vocab_size"] - 1 for v in value]
    if "num_key_value_heads" in out and out.get("num_attention_heads", 4) < out["num_key_value_heads"]:
        out["num_key_value_heads"] = out["num_attention_heads"]
    if "qk_rope_head_dim" in defaults and "head_dim" in defaults:  # MLA: rotary over the rope part
        out["head_dim"] = out.get("qk_rope_head_dim", defaults["qk_rope_head_dim"])
    for key in ("rope_scaling", "rope_parameters"):  # multimodal rope sections add up to half a head
        value = defaults.get(key)
        if isinstance(value, dict) and isinstance(value.get("mrope_section"), list):
            half = out.get("head_dim", defaults.get("head_dim") or 16) // 2
            sections = value["mrope_section"]
            scaled = [max(1, s * half // sum(sections)) for s in sections]
            scaled[0] += half - sum(scaled)
            out[key] = {**value, "mrope_section": scaled}
    for key, value in defaults.items():  # vision/audio towers and other sub-configs shrink too
        if key.endswith("_config") and isinstance(value, dict) and "model_type" in value:
            out[key] = {**value, **tiny_overrides(value, min(num_layers, 2))}
    return out


def tiny_config(model_type: str, num_layers: int = NUM_LAYERS, **extra):
    """A tiny config of ``model_type`` (see the module docstring); ``extra`` overrides."""
    from transformers import AutoConfig

    defaults = AutoConfig.for_model(model_type).to_dict()
    overrides = tiny_overrides(defaults, num_layers)
    overrides["experts_implementation"] = "eager"  # grouped_mm kernels take no float64
    overrides.update(extra)
    config = AutoConfig.for_model(model_type, **overrides)
    if getattr(config, "tie_word_embeddings", None) is None:
        config.tie_word_embeddings = False
    return config


def tiny_model(model_type: str, *, seed: int = 1234, dtype: torch.dtype = torch.float64, causal_lm: Optional[bool] = None,
               **extra) -> nn.Module:
    """The same random tiny model on every rank: a causal LM where the type has one (else its
    base model), in ``dtype``, in training mode (dropout is off in the config)."""
    from transformers import AutoModel, AutoModelForCausalLM

    config = tiny_config(model_type, **extra)
    torch.manual_seed(seed)
    cls = model_class(config, causal_lm)
    model = cls._from_config(config, dtype=dtype)
    return model.train()


def model_class(config, causal_lm: Optional[bool] = None) -> type:
    """The causal-LM class of a config (else its base model class): from transformers' auto
    mappings, or, for a text sub-config they do not list, from its modeling module."""
    import importlib

    from transformers import AutoModel, AutoModelForCausalLM, PreTrainedModel

    for auto, wanted in ((AutoModelForCausalLM, causal_lm is not False), (AutoModel, not causal_lm)):
        if wanted and type(config) in auto._model_mapping:
            return auto._model_mapping[type(config)]
    package = type(config).__module__.rsplit(".", 1)[0]
    name = type(config).__module__.rsplit(".", 1)[1].replace("configuration_", "modeling_")
    module = importlib.import_module(f"{package}.{name}")
    found = [c for c in vars(module).values() if isinstance(c, type) and issubclass(c, PreTrainedModel)
             and getattr(c, "config_class", None) is type(config) and "PreTrained" not in c.__name__]
    found.sort(key=lambda c: (not c.__name__.endswith("ForCausalLM") if causal_lm is not False else
                              c.__name__.endswith("ForCausalLM"), len(c.__name__)))
    if not found:
        raise ValueError(f"no model class for {type(config).__name__}")
    return found[0]


def causal_lm_types() -> List[str]:
    """Model types whose config carries both a tensor- and a pipeline-parallel plan."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    types = []
    for model_type, cls in CONFIG_MAPPING.items():
        try:
            if getattr(cls, "base_model_tp_plan", None) and getattr(cls, "base_model_pp_plan", None):
                types.append(model_type)
        except Exception:  # a config class that fails to import its dependencies
            continue
    return sorted(types)
