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
    "num_attention_heads": 4, "encoder_attention_heads": 4, "decoder_attention_heads": 4, "n_head": 4,
    "num_heads": 4, "num_key_value_heads": 2, "num_kv_heads": 2,
    "head_dim": 16, "swa_head_dim": 16, "attention_head_dim": 16, "swa_num_attention_heads": 4,
    "swa_num_key_value_heads": 2, "linear_num_heads": 4, "rel_extent": 32,
    "vocab_size": 97, "max_position_embeddings": 128, "n_positions": 128, "n_ctx": 128,
    "num_experts": 4, "n_routed_experts": 4, "num_local_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "moe_topk": 2, "top_k": 2, "moe_k": 2,
    "zero_expert_num": 2,
    "n_group": 1, "topk_group": 1, "num_expert_group": 1, "n_shared_experts": 1, "num_shared_experts": 1,
    "moe_num_shared_experts": 1, "num_sliding_attention_heads": 4,
    "kv_lora_rank": 16, "q_lora_rank": 24, "o_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8,
    "v_head_dim": 16, "qk_head_dim": 16, "index_head_dim": 16, "index_n_heads": 2, "index_topk": 8, "index_kpool": 4,
    "o_groups": 2, "num_attention_heads_per_layer": 4,
    "linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_head_dim": 8, "linear_num_key_heads": 2,
    "linear_num_value_heads": 4, "linear_conv_kernel_dim": 4,
    "ext_pw_out_channel": 64, "depthwise_separable_out_channel": 64, "nemo_conv_channels": 64,
    "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": 97,
    "sliding_window": 8, "sliding_window_size": 8, "attention_window_size": 8, "keep_window_size": 8, "max_window_layers": 2,
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "decoder_sparse_step": 1,
    "query_pre_attn_scalar": 16, "rotary_dim": 8, "partial_rotary_dim": 8,
    "hidden_size_global": 64, "encoder_hash_byte_group_vocab": 97,  # a byte-latent model's (BLT) sub-configs
    # adapters between a tower and the text model (dots3)
    "adapter_in_dim": 64, "adapter_out_dim": 64, "adapter_input_size": 64,
    # state-space (Mamba) layers: their scan pads the sequence to a whole chunk, so a default
    # chunk of 256 and state of 256 make a 16-token step take minutes on a CPU.
    "mamba_n_heads": 4, "mamba_num_heads": 4, "n_mamba_heads": 4, "mamba_d_state": 16, "ssm_state_size": 16,
    "state_size": 16, "mamba_chunk_size": 8, "chunk_size": 8, "n_groups": 2, "mamba_dt_rank": 8, "time_step_rank": 8,
}
# Mamba heads x head size = expand x hidden size (the scan's inner width): (heads, head size) keys.
SSM_HEADS = (("mamba_n_heads", "mamba_d_head"), ("mamba_num_heads", "mamba_head_dim"), ("n_mamba_heads", "mamba_headdim"),
             ("num_heads", "head_dim"))
# Attribute -> (value, attributes any of which makes it needed): left None by some defaults.
EXPERT_COUNTS = ("n_routed_experts", "num_experts", "num_local_experts")
NEEDED = {"num_experts_per_tok": (2, EXPERT_COUNTS), "top_k_experts": (2, EXPERT_COUNTS),
          "n_routed_experts": (4, EXPERT_COUNTS), "num_experts": (4, EXPERT_COUNTS),
          "n_shared_experts": (1, ("n_routed_experts",)), "moe_intermediate_size": (32, EXPERT_COUNTS),
          "head_dim": (16, ("num_attention_heads",))}
# Per-type attributes on top of the generic rules, each with why the rules do not fit the type.
OVERRIDES: Dict[str, tuple] = {
    "esmc": ({"num_key_value_heads": 4}, "its validator rejects grouped-query attention"),
    "dots3_note_text": ({"per_layer_config": {i: {"num_attention_heads": 2, "num_key_value_heads": 2, "kv_lora_rank": 32,
                                                  "qk_nope_head_dim": 24} for i in (2, 3)}},
                        "its sliding layers' head_dim must equal their qk_nope_head_dim + qk_rope_head_dim"),
    "deepseek_ocr2_text": ({"mlp_layer_types": ["dense", "sparse", "sparse", "sparse"]},
                           "its default leaves mlp_layer_types None, which its decoder layers index"),
    "gemma3n_text": ({"layer_types": ["sliding_attention", "full_attention"] * 2, "num_kv_shared_layers": 2},
                     "its last layers reuse the cache of an earlier layer of their kind: both kinds come first"),
    "step3p5": ({"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"] * 2},
                "it always builds a sliding-window mask (the default leaves sliding_window None)"),
    "cohere_compass_text": ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
                            "its rotary embedding wants rope parameters per layer type (the default has none)"),
    "deepseek_v4": ({"compress_rates": {"compressed_sparse_attention": 2, "heavily_compressed_attention": 8}},
                    "its heavily compressed layers pool 128 tokens: 8 lets 16 tokens reach the compressor"),
    "zamba": ({"layers_block_type": ["linear_attention", "hybrid"] * 2},
              "its hybrid layers share one attention block, tied from the first to the others: it needs two"),
    "hrm_text": ({"num_hidden_layers": 2}, "num_hidden_layers counts the layers of each of its two stacks"),
    "higgs_audio_v2": ({"num_codebooks": 2, "codebook_size": 32, "audio_stream_bos_id": 32, "audio_stream_eos_id": 33},
                       "its audio embedding and head are num_codebooks x codebook_size rows"),
    "gpt_neo": ({"attention_types": [[["global", "local"], NUM_LAYERS // 2]]},
                "its attention_types expands to one kind per layer, which must count num_layers"),
    "diffllama": ({"num_key_value_heads": 4}, "its default has as many key/value heads as query heads; its differential "
                  "halves at 2 leave one key/value head per half, which tp=2 cannot split"),
    "nemotron": ({"num_key_value_heads": 2}, "its default leaves num_key_value_heads None, which its attention divides by"),
    "lfm2_moe": ({"layer_types": ["conv", "full_attention"] * (NUM_LAYERS // 2)},
                 "its default leaves layer_types None, which its decoder layers index"),
    "qwen4_exp_text": ({"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 8,
                        "indexer_compress_ratio": 4},
                       "its default leaves the indexer (QSA) sizes None, which its indexed-attention layers divide"),
    "reformer": ({"is_decoder": True, "axial_pos_shape": [4, 4], "axial_pos_embds_dim": [16, 48]},
                 "its causal-LM class requires is_decoder; in training its axial positions multiply to the sequence "
                 "length (16) and their widths add up to the hidden size"),
    "xmod": ({"default_language": "en_XX"}, "its forward needs a language (lang_ids, else the config's default)"),
    "t5_gemma_module": ({"dropout_rate": 0.0}, "its modeling reads dropout_rate, which the config does not declare"),
    "t5gemma2_text": ({"dropout_rate": 0.0}, "its modeling reads dropout_rate, which the config does not declare"),
    "t5gemma2_decoder": ({"dropout_rate": 0.0}, "its modeling reads dropout_rate, which the config does not declare"),
}
# Per-type model class (name in the type's modeling module), where the lookup finds none, with why.
MODEL_CLASSES: Dict[str, tuple] = {
    "t5_gemma_module": ("T5GemmaEncoder", "the encoder/decoder stack config: its encoder runs on token ids alone"),
}
# Types whose tiny model builds but cannot run a forward and backward on token ids alone.
UNBUILDABLE: Dict[str, str] = {
    "deepseek_ocr2_encoder": "a vision encoder: its forward takes patch embeddings and num_patches, no token ids",
    "qwen3_omni_moe_talker_code_predictor": "its forward takes inputs_embeds only (raises on input_ids)",
    "qwen3_omni_moe_talker_text": "its forward embeds input_ids with embed_tokens, which it never builds "
                                  "(it builds codec_embedding): transformers 5.24 modeling bug",
    "t5gemma2_decoder": "a cross-attention decoder: its forward needs encoder_hidden_states",
    "dbrx": "its attention reads attn_config.rope_theta, which DbrxAttentionConfig no longer has (its default "
            "config included): transformers 5.24 cannot build it",
    "gemma4_assistant": "a speculative-decoding drafter: its forward ignores input_ids and takes inputs_embeds and "
                        "the target model's shared_kv_states",
    "gemma4_unified_assistant": "a speculative-decoding drafter: its forward ignores input_ids and takes inputs_embeds "
                                "and the target model's shared_kv_states",
    "git": "its causal-LM loss drops the first image_patch_tokens positions of the logits (at least 2) as image "
           "tokens even without pixel_values, leaving fewer logits than labels: on token ids alone transformers 5.24 "
           "computes no loss",
    "musicgen": "its causal LM takes input_ids of [batch x num_codebooks, seq] and labels of [batch, seq, "
                "num_codebooks], not token ids and labels of one shape",
    "musicgen_melody": "its causal LM takes input_ids of [batch x num_codebooks, seq] and labels of [batch, seq, "
                       "num_codebooks], not token ids and labels of one shape",
    "xglm": "its attention clamps scores with torch.full((), finfo(dtype).min) in the default dtype (float32), which "
            "overflows for a float64 model: transformers 5.24 cannot run it in float64",
    "voxtral_realtime_text": "its decoder layers scale by a time-conditioning embedding t_cond that token ids "
                             "do not provide (the audio model passes it)",
}
# Types whose tiny model runs but which no pipeline can cut, and why (the sweep prints the reason).
NOT_PIPELINED: Dict[str, str] = {
    "hrm_text": "its forward runs its two stacks of layers (L_module, H_module) in cycles, each layer several times "
                "per step, and its base_model_pp_plan names a `layers` module HrmTextModel does not have: transformers "
                "itself cannot pipeline it",
}
# Types whose training-mode forward draws random numbers no config turns off. The TP check draws them
# as the reference did (fork_rng); the microbatched checks (pp, cp) run them in eval mode (gradients
# flow the same), since a microbatch draws other numbers than the whole batch. Type -> why.
RANDOM_IN_TRAINING: Dict[str, str] = {
    "phimoe": "its router samples experts with Gumbel noise in training mode (sparsemixer)",
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


def _scaled_sections(sections: List[int], total: int) -> List[int]:
    """``sections`` rescaled to sum to ``total`` (largest remainders round up), each at least 1."""
    exact = [s * total / sum(sections) for s in sections]
    out = [max(1, int(e)) for e in exact]
    for i in sorted(range(len(out)), key=lambda i: int(exact[i]) - exact[i])[: total - sum(out)]:
        out[i] += 1
    return out


def _default_mrope_sections(config_class: type) -> Optional[List[int]]:
    """The multimodal rope sections a type's modeling code falls back on when its config has none
    (``rope_parameters.get("mrope_section", [...])``), else None."""
    import importlib
    import inspect
    import re

    package, name = config_class.__module__.rsplit(".", 1)
    try:
        source = inspect.getsource(importlib.import_module(f"{package}.{name.replace('configuration_', 'modeling_')}"))
    except Exception:  # no modeling module of that name
        return None
    found = re.search(r'mrope_section",\s*\[([\d,\s]+)\]', source)
    return [int(v) for v in found.group(1).split(",")] if found else None


def tiny_overrides(defaults: Dict, num_layers: int = NUM_LAYERS, aliases: Optional[Dict] = None) -> Dict:
    """The attributes to set on a default config (``defaults``: its ``to_dict()``; ``aliases``: its
    class's ``attribute_map``, standard name -> the name it stores)."""
    out: Dict = {}
    sizes = dict(SIZES)
    for alias, real in (aliases or {}).items():  # e.g. num_experts_per_tok stored as num_experts_per_token
        if alias in SIZES and real not in SIZES:
            sizes[real] = SIZES[alias]
    layer_counts = {"num_hidden_layers", "n_layer", "num_layers", "num_blocks"}
    layer_counts |= {real for alias, real in (aliases or {}).items() if alias in layer_counts}
    for key, value in defaults.items():
        if key in sizes and isinstance(value, int) and not isinstance(value, bool):
            out[key] = min(value, sizes[key]) if key != "vocab_size" else sizes[key]
        elif isinstance(value, list) and key in sizes and value and all(isinstance(v, int) for v in value):
            tiny = [min(v, sizes[key]) for v in value]  # a size per layer, or per modality
            out[key] = _layer_list(tiny, num_layers) if len(value) == defaults.get("num_hidden_layers") else tiny
        elif key in NEEDED and value is None and any(k in defaults for k in NEEDED[key][1]):
            out[key] = NEEDED[key][0]
        elif key in layer_counts and isinstance(value, int):
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
    _fit_ssm_width(defaults, out)
    if "num_key_value_heads" in out and out.get("num_attention_heads", 4) < out["num_key_value_heads"]:
        out["num_key_value_heads"] = out["num_attention_heads"]
    if "kv_lora_rank" in defaults and "num_key_value_heads" in out:  # MLA: one latent expands to every head
        out["num_key_value_heads"] = out.get("num_attention_heads", 4)
    if defaults.get("qk_rope_head_dim") and defaults.get("head_dim"):  # MLA: rotary spans the rope part
        out["head_dim"] = out["qk_rope_head_dim"] * defaults["head_dim"] // defaults["qk_rope_head_dim"]
    for key in ("rope_scaling", "rope_parameters"):  # multimodal rope sections add up to half a head
        value = defaults.get(key)
        if isinstance(value, dict) and isinstance(value.get("mrope_section"), list) and value["mrope_section"]:
            half = out.get("head_dim", defaults.get("head_dim") or 16) // 2
            out[key] = {**value, "mrope_section": _scaled_sections(value["mrope_section"], half)}
    for key, value in defaults.items():  # vision/audio towers and other sub-configs (MusicGen's decoder) shrink too
        if isinstance(value, dict) and "model_type" in value:
            own = OVERRIDES.get(value["model_type"], ({}, ""))[0]
            # Towers get 2 layers; a sub-config with its own override (written for a full stack) the full count.
            layers = num_layers if own else min(num_layers, 2)
            out[key] = {**value, **tiny_overrides(value, layers, _aliases(value["model_type"])), **own}
    if defaults.get("per_layer_config") and isinstance(defaults.get("layer_types"), list):
        out["per_layer_config"] = _tiny_per_layer(defaults, out)
    elif defaults.get("per_layer_config") and "num_hidden_layers" in out:  # no kinds: the layers kept keep theirs
        out["per_layer_config"] = {i: v for i, v in defaults["per_layer_config"].items()
                                   if int(i) < out["num_hidden_layers"]}
    return out


def _fit_ssm_width(defaults: Dict, out: Dict) -> None:
    """Mamba head sizes (and Falcon-H1's ``mamba_d_ssm``) that make heads x head size the tiny
    expand x hidden size, as the configs' validators require."""
    expand = defaults.get("mamba_expand", defaults.get("expand"))
    hidden = out.get("hidden_size")
    if not isinstance(expand, int) or not hidden:
        return
    for heads, size in SSM_HEADS:
        if isinstance(defaults.get(heads), int) and isinstance(defaults.get(size), int):
            out[size] = expand * hidden // out.get(heads, defaults[heads])
            if "mamba_d_ssm" in defaults:
                out["mamba_d_ssm"] = expand * hidden


def _tiny_per_layer(defaults: Dict, out: Dict) -> Dict:
    """``per_layer_config`` (layer index -> the attributes that layer overrides, e.g. the global
    layers' larger head_dim) for the tiny layer list: each tiny layer takes the overrides of the
    first default layer of its kind, each size keeping its ratio to the model-wide value."""
    per_layer = {int(i): v for i, v in defaults["per_layer_config"].items()}
    by_kind: Dict = {}
    for i, kind in enumerate(defaults["layer_types"]):
        by_kind.setdefault(kind, per_layer.get(i))
    tiny = {}
    for i, kind in enumerate(out.get("layer_types", defaults["layer_types"])):
        if by_kind.get(kind):
            tiny[i] = {key: max(1, round(out[key] * value / defaults[key]))
                       if key in out and isinstance(value, int) and defaults.get(key) else value
                       for key, value in by_kind[kind].items()}
    return tiny


def _aliases(model_type: str) -> Dict:
    """The ``attribute_map`` of a model type's config class (empty when unknown)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        return dict(getattr(CONFIG_MAPPING[model_type], "attribute_map", {}) or {})
    except Exception:  # not a registered type, or its config fails to import
        return {}


def tiny_config(model_type: str, num_layers: int = NUM_LAYERS, **extra):
    """A tiny config of ``model_type`` (see the module docstring); ``extra`` overrides."""
    from transformers import AutoConfig

    default = AutoConfig.for_model(model_type)
    overrides = tiny_overrides(default.to_dict(), num_layers, getattr(default, "attribute_map", None))
    rope = overrides.get("rope_parameters", getattr(default, "rope_parameters", None))
    sections = _default_mrope_sections(type(default))
    if isinstance(rope, dict) and "rope_type" in rope and "mrope_section" not in rope and sections:
        partial = rope.get("partial_rotary_factor") or getattr(default, "partial_rotary_factor", None) or 1.0
        half = int((overrides.get("head_dim") or SIZES["head_dim"]) * partial) // 2  # the code's default fits a big head
        overrides["rope_parameters"] = {**rope, "mrope_section": _scaled_sections(sections, half)}
    overrides.update(OVERRIDES.get(model_type, ({}, ""))[0])
    overrides["experts_implementation"] = "eager"  # grouped_mm kernels take no float64
    overrides.update(extra)
    config = AutoConfig.for_model(model_type, **overrides)
    if getattr(config, "tie_word_embeddings", None) is None:
        config.tie_word_embeddings = False
    return config


def tiny_model(model_type: str, *, seed: int = 1234, dtype: torch.dtype = torch.float64, causal_lm: Optional[bool] = None,
               jitter: float = 0.02, **extra) -> nn.Module:
    """The same random tiny model on every rank: a causal LM where the type has one (else its
    base model), in ``dtype``, in training mode (dropout is off in the config).

    Args:
        model_type: a transformers model type (see ``causal_lm_types``).
        seed: the seed of the initialisation; the same seed gives the same parameters.
        dtype: the parameters' dtype (float64: all of them, those transformers keeps in
            float32 too, as ``model_checks.float64_throughout`` turns casts to float32 into
            casts to float64).
        causal_lm: True for the causal-LM class, False for the base model, None for either.
        jitter: the std of a seeded normal noise added to every parameter initialised to one
            constant (zero biases, unit norms, zero gates such as doge's ``A``): a constant would
            hide a misplaced shard, and a zero gate cuts the gradient of its branch.
        extra: config attributes, on top of the tiny ones.
    """
    config = tiny_config(model_type, **extra)
    cls = model_class(config, causal_lm)
    config = _config_for(cls, config)
    torch.manual_seed(seed)
    model = cls._from_config(config, dtype=dtype)
    if dtype == torch.float64:  # modules transformers keeps in float32 too: float64_throughout casts to float64
        model.to(torch.float64)
    if jitter:
        generator = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for param in model.parameters():
                if param.numel() and bool(param.min() == param.max()):
                    noise = torch.randn(param.shape, generator=generator, dtype=torch.float64)
                    param.add_((jitter * noise).to(param.dtype))
    return model.train()


def _config_for(cls: type, config):
    """The sub-config a composite config's model class is built from (its text or decoder config,
    as ``AutoModelForCausalLM.from_config`` hands the text config), else ``config``."""
    wanted = getattr(cls, "config_class", None)
    if wanted is None or isinstance(config, wanted):
        return config
    for key in getattr(config, "sub_configs", {}):
        sub = getattr(config, key, None)
        if isinstance(sub, wanted):
            return sub
    return config


def model_class(config, causal_lm: Optional[bool] = None) -> type:
    """The causal-LM class of a config (else its base model class): from transformers' auto
    mappings, or, for a text sub-config they do not list (or list under a name the package does
    not export), from its modeling module; ``MODEL_CLASSES`` names it where neither finds it."""
    import importlib

    from transformers import AutoModel, AutoModelForCausalLM, PreTrainedModel

    package, name = type(config).__module__.rsplit(".", 1)
    module_name = f"{package}.{name.replace('configuration_', 'modeling_')}"
    if config.model_type in MODEL_CLASSES:
        return getattr(importlib.import_module(module_name), MODEL_CLASSES[config.model_type][0])
    for auto, wanted in ((AutoModelForCausalLM, causal_lm is not False), (AutoModel, not causal_lm)):
        if wanted and type(config) in auto._model_mapping:
            try:
                return auto._model_mapping[type(config)]
            except ValueError:  # mapped to a class the package does not export
                pass
    found = [c for c in vars(importlib.import_module(module_name)).values() if isinstance(c, type) and issubclass(c, PreTrainedModel)
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
