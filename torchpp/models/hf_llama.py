"""Converting transformers' Llama, Mistral, Mixtral, Qwen2, Qwen3, Gemma (1 to 3) and Phi-3
causal LMs into TP stage pieces."""
from __future__ import annotations

import copy
import sys

from torch import nn

from torchpp import tensor_parallel as tp
from torchpp.models import hf_convert as C
from torchpp.models.hf_moe import sparse_moe
from torchpp.models.hf_layers import (
    DecoderBlock, FusedGatedMLP, FusedQKV, GatedMLP, ParallelLMHead, ParallelSelfAttention, ParallelTokenEmbedding,
    SeparateQKV,
)


class LlamaFamily:
    """Llama-style decoder (RMSNorm, rotary, GQA, gated MLP); Mistral adds a sliding window, Qwen2
    q/k/v biases and a sliding window on some layers only, Qwen3 a norm over each query and key head,
    Gemma a scaled token embedding (its (1 + weight) norms are the model's own modules, copied),
    Gemma 2 norms after attention and MLP too, tanh-capped attention scores and logits, and a
    sliding window on alternate layers, Gemma 3 (text) Qwen3's q/k norms and a rotary table per
    attention type, Phi-3 fused qkv and gate_up projections and residual dropout, Mixtral a
    sparse mixture of experts (``hf_moe``).

    Args:
        model: the HF causal LM (left untouched; its tensors are copied into shards).
        ctx: the shared conversion context (``hf.ConversionContext``).
    """

    def __init__(self, model: nn.Module, ctx):
        self.model, self.ctx, self.config = model, ctx, model.config
        config = self.config
        self.num_layers = config.num_hidden_layers
        self.vocab_size = config.vocab_size
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        heads, kv_heads, t = config.num_attention_heads, config.num_key_value_heads, ctx.tp_size
        if heads % t or (kv_heads % t and t % kv_heads):
            raise ValueError(
                f"torchpp.parallelize: tp={t} must divide num_attention_heads={heads} and either divide "
                f"num_key_value_heads={kv_heads} or be a multiple of it (each TP rank holds whole query heads "
                f"and whole key/value heads, copies of them when tp exceeds their number)"
            )
        # tp > kv heads: each key/value head is copied onto kv_replicas consecutive TP ranks.
        self.kv_replicas = max(t // kv_heads, 1)
        if getattr(config, "router_jitter_noise", 0.0) or getattr(config, "output_router_logits", False):
            raise NotImplementedError("torchpp.parallelize: router_jitter_noise and output_router_logits (the "
                                      "load-balancing loss) are not supported")
        if getattr(config, "use_bidirectional_attention", False):
            raise NotImplementedError("torchpp.parallelize: use_bidirectional_attention=True is not supported "
                                      "(attention is causal)")
        # apply_rotary_pos_emb of the model's own modeling module, so its RoPE variant is kept.
        self._apply_rope = sys.modules[type(model.model.layers[0].self_attn).__module__].apply_rotary_pos_emb

    def rotary(self) -> nn.Module:
        rotary = self.model.model.rotary_emb
        if any(buffer.is_meta for buffer in rotary.buffers()):  # a meta model: recompute its frequencies
            return type(rotary)(config=self.config)
        return copy.deepcopy(rotary)

    def embedding(self) -> ParallelTokenEmbedding:
        tokens = tp.VocabParallelEmbedding.from_embedding(self.model.model.embed_tokens, pad_vocab=True, **self.ctx.embedding_kwargs)
        self.ctx.exports.append(C.Export("model.embed_tokens.weight", tokens.weight, C.TrimmedRows(self.vocab_size)))
        embed = self.model.model.embed_tokens
        scale = getattr(embed, "scalar_embed_scale", getattr(embed, "embed_scale", None))  # Gemma's sqrt(hidden)
        return ParallelTokenEmbedding(tokens, sequence_parallel=self.ctx.sequence_parallel,
                                      scale=None if scale is None else float(scale))

    def block(self, index: int) -> DecoderBlock:
        ctx, layer, prefix = self.ctx, self.model.model.layers[index], f"model.layers.{index}"
        attn = layer.self_attn
        qkv = self._qkv(attn, prefix)
        o = C.row(attn.o_proj, **ctx.linear_kwargs)
        C.export_linear(ctx.exports, o, f"{prefix}.self_attn.o_proj", C.cat_columns, C.replicated)
        t, config = ctx.tp_size, self.config
        attention = ParallelSelfAttention(
            qkv, o,
            num_heads=config.num_attention_heads // t,
            num_kv_heads=config.num_key_value_heads * self.kv_replicas // t,
            head_dim=attn.head_dim, scaling=attn.scaling, dropout=config.attention_dropout,
            apply_rope=self._apply_rope, sliding_window=self._sliding_window(attn),
            recompute_core=ctx.recompute == "selective", softcap=getattr(config, "attn_logit_softcapping", None),
            **self._head_norms(attn, prefix),
        )
        mlp = self._mlp(layer.mlp, prefix)
        # Gemma 3 rotates sliding-window and full-attention layers by different tables.
        rope_key = config.layer_types[index] if hasattr(self.model.model.rotary_emb, "layer_types") else None
        return DecoderBlock(attention=attention, mlp=mlp, dropout=getattr(config, "resid_pdrop", 0.0),
                            sequence_parallel=ctx.sequence_parallel, rope_key=rope_key, **self._norms(layer, prefix))

    def _norms(self, layer: nn.Module, prefix: str) -> dict:
        """The block's norms, copied and exported: before attention and MLP, and with Gemma 2 and 3
        after each too (there post_attention_layernorm follows attention and
        pre_feedforward_layernorm precedes the MLP)."""
        names = {"norm1": "input_layernorm", "norm2": "post_attention_layernorm"}
        if hasattr(layer, "pre_feedforward_layernorm"):
            names = {"norm1": "input_layernorm", "post_norm1": "post_attention_layernorm",
                     "norm2": "pre_feedforward_layernorm", "post_norm2": "post_feedforward_layernorm"}
        norms = {}
        for role, name in names.items():
            norms[role] = copy.deepcopy(getattr(layer, name))
            C.export_module(self.ctx.exports, norms[role], f"{prefix}.{name}")
        return norms

    def _qkv(self, attn: nn.Module, prefix: str) -> nn.Module:
        """Column-parallel q, k and v: separate, or Phi-3's fused qkv_proj with its rows grouped by rank."""
        ctx, t = self.ctx, self.ctx.tp_size
        if hasattr(attn, "qkv_proj"):
            if self.kv_replicas > 1:
                raise ValueError(f"torchpp.parallelize: a fused qkv_proj needs tp={t} to divide "
                                 f"num_key_value_heads={self.config.num_key_value_heads}")
            kv_rows = self.config.num_key_value_heads * attn.head_dim
            blocks = [self.config.num_attention_heads * attn.head_dim, kv_rows, kv_rows]
            qkv = C.fused_column(ctx, attn.qkv_proj, blocks, f"{prefix}.self_attn.qkv_proj")
            return FusedQKV(qkv, [rows // t for rows in blocks])
        q = C.column(attn.q_proj, **ctx.linear_kwargs)
        C.export_linear(ctx.exports, q, f"{prefix}.self_attn.q_proj", C.cat_rows, C.cat_rows)
        k, v = (self._kv_projection(getattr(attn, name), attn.head_dim, f"{prefix}.self_attn.{name}")
                for name in ("k_proj", "v_proj"))
        return SeparateQKV(q, k, v)

    def _kv_projection(self, linear: nn.Linear, head_dim: int, hf_name: str) -> nn.Module:
        """A column-parallel k or v projection; with more TP ranks than heads, each rank's copy
        of the head its query heads share."""
        ctx, replicas = self.ctx, self.kv_replicas
        if replicas == 1:
            layer = C.column(linear, **ctx.linear_kwargs)
            C.export_linear(ctx.exports, layer, hf_name, C.cat_rows, C.cat_rows)
            return layer
        layer = C.column(C.copy_heads(linear, head_dim, replicas), **ctx.linear_kwargs)
        for param in layer.parameters():
            tp.mark_tp_replicas(param, replicas, layer.tp_rank)
        copies = C.HeadCopies(replicas)
        C.export_linear(ctx.exports, layer, hf_name, copies, copies)
        return layer

    def _mlp(self, mlp: nn.Module, prefix: str) -> nn.Module:
        """The gated MLP: separate gate and up projections, Phi-3's fused gate_up_proj, or
        Mixtral's sparse mixture of such experts."""
        ctx = self.ctx
        if hasattr(mlp, "experts"):
            return sparse_moe(ctx, mlp, self.config.intermediate_size, f"{prefix}.mlp")
        down = C.row(mlp.down_proj, **ctx.linear_kwargs)
        C.export_linear(ctx.exports, down, f"{prefix}.mlp.down_proj", C.cat_columns, C.replicated)
        if hasattr(mlp, "gate_up_proj"):
            gate_up = C.fused_column(ctx, mlp.gate_up_proj, [self.config.intermediate_size] * 2,
                                     f"{prefix}.mlp.gate_up_proj")
            return FusedGatedMLP(gate_up, down, mlp.activation_fn)
        gate, up = C.column(mlp.gate_proj, **ctx.linear_kwargs), C.column(mlp.up_proj, **ctx.linear_kwargs)
        C.export_linear(ctx.exports, gate, f"{prefix}.mlp.gate_proj", C.cat_rows, C.cat_rows)
        C.export_linear(ctx.exports, up, f"{prefix}.mlp.up_proj", C.cat_rows, C.cat_rows)
        return GatedMLP(gate, up, down, mlp.act_fn)

    def _sliding_window(self, attn: nn.Module):
        # Qwen2 sets it per layer (its layer_types); Mistral's attention reads the config's.
        if hasattr(attn, "sliding_window"):
            return attn.sliding_window
        return getattr(self.config, "sliding_window", None)

    def _head_norms(self, attn: nn.Module, prefix: str) -> dict:
        """Qwen3's per-head q_norm / k_norm, copied and exported; {} for the others."""
        if not hasattr(attn, "q_norm"):
            return {}
        norms = {name: copy.deepcopy(getattr(attn, name)) for name in ("q_norm", "k_norm")}
        for name, norm in norms.items():
            C.export_module(self.ctx.exports, norm, f"{prefix}.self_attn.{name}")
        return norms

    def head(self) -> ParallelLMHead:
        return C.lm_head(self.ctx, self.model.model.norm, "model.norm", self.model.lm_head, self.vocab_size,
                         softcap=getattr(self.config, "final_logit_softcapping", None))
