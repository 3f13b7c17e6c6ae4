"""Attention written in a model's own code instead of through transformers' attention functions,
routed to sharded attention family by family: the module keeps its projections, rotary tables,
head splits and output projection, and only the softmax over the keys becomes the cp attention
function (``hf._attention``: masks by global position, packed rows, refusals).

- GPT-Neo (``GPTNeoSelfAttention._attn``): unscaled scores, local layers a causal window of
  ``config.window_size``; its scores are computed in float32 whatever the model's dtype.
  GPT-NeoX-Japanese's and OpenAI GPT's ``_attn`` likewise (OpenAI GPT's mask does not split
  packed rows, so neither does sharded attention for it).
- Falcon (``FalconAttention.forward``): multi-query, grouped and the new decoder architecture's
  heads; rotary positions, or ALiBi (``config.alibi``), whose bias its model rounds to bfloat16:
  rebuilt alike over every key of the sequence and added to this rank's scores over gathered keys
  (``falcon_key_bias``).
- Bloom and MPT (ALiBi): their per-head slopes, read from the bias rows the model built for this
  rank's heads, become the op's ``alibi_slopes`` (``slope * (j - i)`` by global position, which
  equals their ``slope * j`` up to a constant per query row, which the softmax ignores). Both
  compute their softmax in float32 whatever the model's dtype.
- MegatronBERT's, RemBERT's, RoFormer's and BigBird's (full attention; block-sparse refused)
  BERT-style self-attention (``forward`` written out:
  query, key and value projections, RoFormer's rotary; causal when the model is a decoder, else
  bidirectional, as their masks), and
  MVP's and TrOCR's copies of BART's attention (scaled queries, an output projection), XLM's
  (causal when the model gives it a causal mask).
  Cross-attention and MVP's prompt keys are refused.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from torchpp.context_parallel.families import lookup


# Each adapter calls module._torchpp_cp_attention (set by apply_own_attention: the plain or the
# recomputing attention function, as the recompute pass chooses on its second application).


def _gpt_neo(module: nn.Module) -> None:
    window = module.config.window_size if module.attention_type == "local" else None

    def _attn(query, key, value, attention_mask=None):
        out, _ = module._torchpp_cp_attention(module, query, key, value, attention_mask, scaling=1.0,
                                               sliding_window=window)
        return out.transpose(1, 2), None  # back to [b, heads, s, d], as _merge_heads takes it
    module._attn = _attn


def _gpt_neox_japanese(module: nn.Module) -> None:
    def _attn(query, key, value, attention_mask=None):
        out, _ = module._torchpp_cp_attention(module, query, key, value, attention_mask,
                                               scaling=1.0 / module.norm_factor)
        return out.transpose(1, 2), None
    module._attn = _attn


def _openai_gpt(module: nn.Module) -> None:
    def _attn(q, k, v, attention_mask=None, output_attentions=False):
        # (its keys come transposed, [b, heads, d, s]; scores scaled by 1/sqrt(d) where module.scale)
        out, _ = module._torchpp_cp_attention(module, q, k.transpose(-1, -2), v, attention_mask,
                                               scaling=None if module.scale else 1.0)
        return [out.transpose(1, 2)] + ([None] if output_attentions else [])
    module._attn = _attn


def falcon_key_bias(alibi: torch.Tensor, module: nn.Module, batch: int, total: int) -> torch.Tensor:
    """[b, heads, 1, total] Falcon's ALiBi bias over every key of the sequence, as its model builds
    it for one process: ``bf16(slope) * j`` rounded to bfloat16 (not linear in j past 256 keys, so
    no slope reproduces it), divided by the square root of the head width. The slopes are read from
    the rows the model built for this rank's shard (and heads), whose key 0 entry is 0."""
    slopes = alibi_slopes(alibi.view(batch, module.num_heads, -1), module).bfloat16()
    keys = torch.arange(total, device=alibi.device)[None, None, :]
    return ((slopes[..., None] * keys).to(alibi.dtype) / math.sqrt(module.head_dim))[:, :, None, :]


def _falcon(module: nn.Module) -> None:
    rotary = sys.modules[type(module).__module__].apply_rotary_pos_emb
    # (transformers' eager path adds the ALiBi bias twice, in its logits and in the mask it merged it
    # into; its SDPA path once. The adapter is applied before the model's path is replaced by cp's.)
    alibi_times = 1 if module.config._attn_implementation == "sdpa" else 2

    def forward(hidden_states, alibi, attention_mask, position_ids=None, layer_past=None, use_cache=False,
                output_attentions=False, position_embeddings=None, **kwargs):
        query, key, value = module._split_heads(module.query_key_value(hidden_states))
        batch, length = query.shape[:2]
        kv_heads = module.num_heads if module.new_decoder_architecture else module.num_kv_heads
        query, key, value = (t.transpose(1, 2).reshape(batch, heads, length, module.head_dim)
                             for t, heads in ((query, module.num_heads), (key, kv_heads), (value, kv_heads)))
        if alibi is None:
            query, key = rotary(query, key, *position_embeddings)
            out, _ = module._torchpp_cp_attention(module, query, key, value, attention_mask, position_ids=position_ids)
        else:  # (this rank's queries against every key, over gathered keys: relative_bias.attend)
            total = length * module.torchpp_cp.size
            bias = alibi_times * falcon_key_bias(alibi, module, batch, total).expand(-1, -1, length, -1)
            out, _ = module._torchpp_cp_attention(module, query, key, value, attention_mask, position_ids=position_ids,
                                                   position_bias=bias)
        return module.dense(out.reshape(batch, length, module.num_heads * module.head_dim)), None
    module.forward = forward


def _cross_attention_refused(module: nn.Module) -> NotImplementedError:
    return NotImplementedError(f"torchpp context parallelism: {type(module).__name__} attends to an encoder's states "
                               f"(cross-attention), which sharded attention does not place in the sequence; run the "
                               f"decoder alone")


def _bert_attend(module: nn.Module, hidden_states, sinusoidal_pos=None):
    # (causal as its model is a decoder: these causal LMs are built bidirectional unless is_decoder)
    shape = (*hidden_states.shape[:-1], -1, module.attention_head_size)
    query, key, value = (getattr(module, name)(hidden_states).view(shape).transpose(1, 2)
                         for name in ("query", "key", "value"))
    if sinusoidal_pos is not None:  # (RoFormer's rotary, its table at global positions: positions.py)
        rotated = module.apply_rotary_position_embeddings(sinusoidal_pos, query, key,
                                                          value if module.rotary_value else None)
        query, key, value = rotated if module.rotary_value else (*rotated, value)
    out, _ = module._torchpp_cp_attention(module, query, key, value, None, scaling=module.attention_head_size ** -0.5,
                                           is_causal=bool(module.is_decoder))
    return out.reshape(*hidden_states.shape[:-1], -1), None


def _bert_self_attention(module: nn.Module) -> None:
    def forward(hidden_states, attention_mask=None, encoder_hidden_states=None, *args, **kwargs):
        if encoder_hidden_states is not None:
            raise _cross_attention_refused(module)
        return _bert_attend(module, hidden_states)
    module.forward = forward


def _roformer_self_attention(module: nn.Module) -> None:
    def forward(hidden_states, attention_mask=None, sinusoidal_pos=None, encoder_hidden_states=None, *args, **kwargs):
        if encoder_hidden_states is not None:
            raise _cross_attention_refused(module)
        return _bert_attend(module, hidden_states, sinusoidal_pos)
    module.forward = forward


def _bart_attention(module: nn.Module) -> None:
    # (MVP's and TrOCR's copies of BART's attention, written out: scaled queries, an output projection)
    def forward(hidden_states, key_value_states=None, cache=None, attention_mask=None, attn_prompt=None, *args,
                **kwargs):
        if key_value_states is not None:
            raise _cross_attention_refused(module)
        if attn_prompt is not None:
            raise NotImplementedError(f"torchpp context parallelism: {type(module).__name__} prepends prompt keys and "
                                      f"values (attn_prompt), which sharded attention cannot place in the sequence")
        shape = (*hidden_states.shape[:-1], -1, module.head_dim)
        query, key, value = (getattr(module, name)(hidden_states).view(shape).transpose(1, 2)
                             for name in ("q_proj", "k_proj", "v_proj"))
        out, _ = module._torchpp_cp_attention(module, query, key, value, None, scaling=module.scaling)
        return module.out_proj(out.reshape(*hidden_states.shape[:-1], -1)), None
    module.forward = forward


def _xlm_attention(module: nn.Module) -> None:
    # (causal when the model gives a [b, s, s] mask, as a causal XLM does; else its mask is padding alone)
    def forward(input, mask, kv=None, cache=None, output_attentions=False, **kwargs):
        if kv is not None:
            raise _cross_attention_refused(module)
        shape = (*input.shape[:-1], -1, module.head_dim)
        query, key, value = (getattr(module, name)(input).view(shape).transpose(1, 2)
                             for name in ("q_lin", "k_lin", "v_lin"))
        out, _ = module._torchpp_cp_attention(module, query, key, value, None, scaling=module.head_dim ** -0.5,
                                               is_causal=mask.dim() == 3)
        outputs = (module.out_lin(out.reshape(*input.shape[:-1], -1)),)
        return outputs + (None,) if output_attentions else outputs
    module.forward = forward


def alibi_slopes(bias_rows: torch.Tensor, module: nn.Module) -> torch.Tensor:
    """[..., heads] slopes from a model's ALiBi rows [..., heads, L] (slope * (j + c) for key j):
    their step from one key to the next. The rows are this rank's heads' under tensor parallelism."""
    if bias_rows.size(-1) < 2:
        raise NotImplementedError(f"torchpp context parallelism: {type(module).__name__}'s ALiBi bias spans one key "
                                  f"on this rank; its slopes need two (a shard of at least 2 tokens)")
    return bias_rows[..., 1] - bias_rows[..., 0]


def _bloom(module: nn.Module) -> None:
    dropout_add = sys.modules[type(module).__module__].dropout_add

    def forward(hidden_states, residual, alibi, attention_mask, layer_past=None, use_cache=False,
                output_attentions=False, **kwargs):
        batch, length = hidden_states.shape[:2]
        query, key, value = module._reshape(module.query_key_value(hidden_states))
        slopes = alibi_slopes(alibi.view(batch, module.num_heads, -1)[0], module)
        out, _ = module._torchpp_cp_attention(module, query, key, value, attention_mask,
                                               scaling=module.inv_norm_factor, alibi_slopes=slopes,
                                               position_ids=kwargs.get("position_ids"))
        context = out.reshape(batch, length, module.num_heads * module.head_dim)
        if module.pretraining_tp > 1 and module.slow_but_exact:  # the dense in slices, as the module sums them
            width = module.hidden_size // module.pretraining_tp
            parts = [slice(i * width, (i + 1) * width) for i in range(module.pretraining_tp)]
            output = sum(F.linear(context[..., part], module.dense.weight[:, part]) for part in parts)
            output = output + module.dense.bias
        else:
            output = module.dense(context)
        return dropout_add(output, residual, module.hidden_dropout, module.training), None
    module.forward = forward


class _NoMask:
    """What MPT's model turns into a boolean mask (``create_causal_mask(...).to(torch.bool)``) when
    transformers builds none, as under cp: stays none."""

    def to(self, *args, **kwargs):
        return None


def _mask_or_placeholder(create_causal_mask: Callable) -> Callable:
    def create(*args, **kwargs):
        mask = create_causal_mask(*args, **kwargs)
        return _NoMask() if mask is None else mask
    create._torchpp_placeholder = True
    return create


def _mpt(module: nn.Module) -> None:
    modeling = sys.modules[type(module).__module__]
    if not getattr(modeling.create_causal_mask, "_torchpp_placeholder", False):
        modeling.create_causal_mask = _mask_or_placeholder(modeling.create_causal_mask)

    def forward(hidden_states, position_bias, cache=None, attention_mask=None, **kwargs):
        batch, length = hidden_states.shape[:2]
        qkv = module.Wqkv(hidden_states)
        if module.clip_qkv:
            qkv = qkv.clamp(min=-module.clip_qkv, max=module.clip_qkv)
        query, key, value = (t.reshape(batch, length, module.n_heads, module.head_dim).transpose(1, 2)
                             for t in qkv.chunk(3, dim=2))
        slopes = None if position_bias is None else alibi_slopes(position_bias[:, 0], module)
        out, _ = module._torchpp_cp_attention(module, query, key, value, attention_mask, scaling=module.softmax_scale,
                                               alibi_slopes=slopes, position_ids=kwargs.get("position_ids"))
        return module.out_proj(out.reshape(batch, length, -1)), None
    module.forward = forward


@dataclass(frozen=True)
class Family:
    """How a family's attention is routed, and what its masks say about positions."""

    adapt: Callable[[nn.Module], None]
    counts_keys_by_index: bool = False  # an ALiBi bias gives the positions: no position ids read
    splits_packed_rows: bool = True  # its mask tells packed rows apart by position ids
    refuses: Optional[Callable[[object], str]] = None  # why a config of the family cannot be served ('' if it can)


def _block_sparse(config) -> str:
    # (BigBird switches to full attention for sequences too short for its blocks, by the length it is given: a
    # shard's would be shorter than the whole sequence's)
    if getattr(config, "attention_type", None) == "block_sparse":
        return ("uses block-sparse attention (config.attention_type='block_sparse'), which sharded attention does not "
                "implement; set attention_type='original_full'")
    return ""


# Attention classes by modeling module and name (flash variants subclass them).
FAMILIES: Dict[str, Family] = {
    "modeling_gpt_neo.GPTNeoSelfAttention": Family(_gpt_neo),
    "modeling_gpt_neox_japanese.GPTNeoXJapaneseAttention": Family(_gpt_neox_japanese),
    "modeling_openai.Attention": Family(_openai_gpt, splits_packed_rows=False),
    "modeling_falcon.FalconAttention": Family(_falcon),
    "modeling_bloom.BloomAttention": Family(_bloom, counts_keys_by_index=True),
    "modeling_mpt.MptAttention": Family(_mpt, counts_keys_by_index=True),
    # (BERT's masks are causal by index alone: they do not split packed rows)
    "modeling_megatron_bert.MegatronBertSelfAttention": Family(_bert_self_attention, splits_packed_rows=False),
    "modeling_rembert.RemBertSelfAttention": Family(_bert_self_attention, splits_packed_rows=False),
    "modeling_roformer.RoFormerSelfAttention": Family(_roformer_self_attention, splits_packed_rows=False),
    # (BigBird's full attention; its block-sparse attention is another module, not routed: refused)
    "modeling_big_bird.BigBirdSelfAttention": Family(_bert_self_attention, splits_packed_rows=False,
                                                     refuses=_block_sparse),
    "modeling_xlm.MultiHeadAttention": Family(_xlm_attention, splits_packed_rows=False),
    "modeling_mvp.MvpAttention": Family(_bart_attention),
    "modeling_trocr.TrOCRAttention": Family(_bart_attention),
}


def _family(module: nn.Module) -> Optional[Family]:
    return lookup(module, FAMILIES)


def own_attention_modules(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """(path, module) of the attention modules of ``model`` that ``apply_own_attention`` routes."""
    return [(name, module) for name, module in model.named_modules() if _family(module) is not None]


def _dropout(dropout) -> float:
    return float(dropout.p if isinstance(dropout, nn.Dropout) else dropout if isinstance(dropout, (int, float)) else 0.0)


def refusal(modules: List[Tuple[str, nn.Module]], config) -> str:
    """Why a model whose routed attention ``modules`` are these still cannot be served ('' when it can)."""
    for _, module in modules:
        refused = _family(module).refuses(config) if _family(module).refuses is not None else ""
        if refused:
            return refused
    # (MPT keeps its attention dropout as a number, OpenAI GPT as a module, BERT's and BART's copies
    # as `dropout`; the others' configs are checked.)
    dropout = max((float(getattr(m, "attn_dropout_p", 0.0) or getattr(getattr(m, "attn_dropout", None), "p", 0.0)
                         or _dropout(getattr(m, "dropout", 0.0))) for _, m in modules), default=0.0)
    if dropout:
        return f"has attention dropout {dropout}, which sharded attention does not implement"
    return ""


def apply_own_attention(model: nn.Module, attention: Callable) -> None:
    """Routes each such module's softmax through ``attention`` (transformers' attention-function
    interface; the cp one)."""
    for _, module in own_attention_modules(model):
        if not hasattr(module, "_torchpp_cp_attention"):
            _family(module).adapt(module)
        module._torchpp_cp_attention = attention


def counts_keys_by_index(modules: List[Tuple[str, nn.Module]]) -> bool:
    """Whether routed attention ``modules`` are biased by ALiBi (Bloom's, MPT's): by key index."""
    return any(_family(module).counts_keys_by_index for _, module in modules)


def splits_packed_rows(modules: List[Tuple[str, nn.Module]]) -> bool:
    """Whether routed attention ``modules`` tell packed rows apart (OpenAI GPT's do not)."""
    return all(_family(module).splits_packed_rows for _, module in modules)


def weights_no_longer_returned(extras: Dict[int, Tuple[bool, ...]]) -> None:
    """A pipeline layout's record of the tensors each layer returns besides its hidden states
    (``PipelineLayout.extras``, traced on the unwrapped model), told that routed attention returns
    no attention weights: the blocks of these families return nothing else, so a stage hands on
    none (stages on either side of a cut read the same record)."""
    for index, kinds in extras.items():
        extras[index] = tuple(False for _ in kinds)

