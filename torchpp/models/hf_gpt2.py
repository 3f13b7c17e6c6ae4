"""Converting transformers' GPT2LMHeadModel (Conv1D projections, fused qkv) into TP stage pieces."""
from __future__ import annotations

import copy

from torch import nn

from torchpp import tensor_parallel as tp
from torchpp.models import hf_convert as C
from torchpp.models.hf_layers import (
    MLP, DecoderBlock, FusedQKV, ParallelLMHead, ParallelSelfAttention, ParallelTokenEmbedding,
)


class GPT2Family:
    """GPT-2 (LayerNorm, learned positions, fused c_attn, Conv1D weights stored [in, out]).

    Args:
        model: the HF GPT2LMHeadModel (left untouched; its tensors are copied into shards).
        ctx: the shared conversion context (``hf.ConversionContext``).
    """

    def __init__(self, model: nn.Module, ctx):
        self.model, self.ctx, self.config = model, ctx, model.config
        config = self.config
        if getattr(config, "add_cross_attention", False):
            raise NotImplementedError("torchpp.parallelize: GPT-2 with cross-attention is not supported")
        self.num_layers = config.n_layer
        self.vocab_size = config.vocab_size
        self.tied = bool(getattr(config, "tie_word_embeddings", True))
        if config.n_head % ctx.tp_size:
            raise ValueError(f"torchpp.parallelize: tp={ctx.tp_size} must divide num_attention_heads={config.n_head}")

    def rotary(self) -> None:
        return None

    def embedding(self) -> ParallelTokenEmbedding:
        ctx, transformer = self.ctx, self.model.transformer
        tokens = tp.VocabParallelEmbedding.from_embedding(transformer.wte, pad_vocab=True, **ctx.embedding_kwargs)
        positions = copy.deepcopy(transformer.wpe)
        ctx.exports.append(C.Export("transformer.wte.weight", tokens.weight, C.TrimmedRows(self.vocab_size)))
        C.export_module(ctx.exports, positions, "transformer.wpe")
        return ParallelTokenEmbedding(tokens, positions, self.config.embd_pdrop, ctx.sequence_parallel)

    def block(self, index: int) -> DecoderBlock:
        ctx, layer, prefix, t = self.ctx, self.model.transformer.h[index], f"transformer.h.{index}", self.ctx.tp_size
        attn, mlp = layer.attn, layer.mlp
        c_attn = C.fused_column(ctx, C.linear_from_conv1d(attn.c_attn), [self.config.n_embd] * 3,  # [q; k; v]
                                f"{prefix}.attn.c_attn", conv1d=True)
        c_proj = C.row(C.linear_from_conv1d(attn.c_proj), **ctx.linear_kwargs)
        c_fc = C.column(C.linear_from_conv1d(mlp.c_fc), **ctx.linear_kwargs)
        mlp_proj = C.row(C.linear_from_conv1d(mlp.c_proj), **ctx.linear_kwargs)
        C.export_linear(ctx.exports, c_proj, f"{prefix}.attn.c_proj", C.cat_columns, C.replicated, conv1d=True)
        C.export_linear(ctx.exports, c_fc, f"{prefix}.mlp.c_fc", C.cat_rows, C.cat_rows, conv1d=True)
        C.export_linear(ctx.exports, mlp_proj, f"{prefix}.mlp.c_proj", C.cat_columns, C.replicated, conv1d=True)
        heads = self.config.n_head // t
        attention = ParallelSelfAttention(
            FusedQKV(c_attn, [attn.head_dim * heads] * 3), c_proj, num_heads=heads, num_kv_heads=heads,
            head_dim=attn.head_dim, scaling=attn.scaling, dropout=self.config.attn_pdrop,
            recompute_core=ctx.recompute == "selective",
        )
        norm1, norm2 = copy.deepcopy(layer.ln_1), copy.deepcopy(layer.ln_2)
        C.export_module(ctx.exports, norm1, f"{prefix}.ln_1")
        C.export_module(ctx.exports, norm2, f"{prefix}.ln_2")
        return DecoderBlock(norm1, attention, norm2, MLP(c_fc, mlp_proj, mlp.act), self.config.resid_pdrop,
                            ctx.sequence_parallel)

    def head(self) -> ParallelLMHead:
        return C.lm_head(self.ctx, self.model.transformer.ln_f, "transformer.ln_f", self.model.lm_head, self.vocab_size)
