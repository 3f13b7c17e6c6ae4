"""What sharded attention can serve in a transformers model, and the refusals of what it cannot,
each naming the module and the reason: at wrap time (``check_model``), at each attention call
(``check_call``), and after each layer (``AttentionCalls``: a layer that mixes the sequence
without calling attention or a sharded short convolution (``halo``), a Mamba, convolution or
recurrent layer, would run on its shard alone).
Under cp transformers builds no mask, so anything a model expresses only through its mask or its
own attention code would otherwise be silently lost."""
from __future__ import annotations

import inspect
import sys
from typing import Dict, Optional

import torch
from torch import nn

from torchpp.context_parallel.delta_rule import defines_delta_rule, delta_rule_convs
from torchpp.context_parallel.compressed import defines_compressed_attention, refusal as compressed_refusal
from torchpp.context_parallel.indexed import defines_indexed_attention, refusal as indexed_refusal
from torchpp.context_parallel.mamba import defines_mamba2, mamba2_convs
from torchpp.context_parallel.relative_bias import refusal as relative_bias_refusal
from torchpp.context_parallel.families import named_in
from torchpp.context_parallel.halo import halo_convs
from torchpp.context_parallel.own_attention import (counts_keys_by_index, own_attention_modules, refusal as own_refusal,
                                                     splits_packed_rows)
from torchpp.context_parallel.positions import ModelPositions, decide_positions
from torchpp.context_parallel.rg_lru import recurrent_block_convs
from torchpp.context_parallel.mlstm import defines_mlstm
from torchpp.context_parallel.rwkv import defines_rwkv
from torchpp.context_parallel.selective_scan import defines_selective_scan, selective_scan_convs

# Layer types whose masks transformers builds otherwise than by position and window.
UNSHARDED_MASKS = {"reference_sliding_attention": "a reference sliding-window mask"}
PREFIX = "torchpp context parallelism"


def layer_type(module: nn.Module) -> Optional[str]:
    """The module's entry of its config's ``layer_types`` (by its ``layer_idx``), or None."""
    types, index = getattr(getattr(module, "config", None), "layer_types", None), getattr(module, "layer_idx", None)
    return types[index] if types is not None and isinstance(index, int) and 0 <= index < len(types) else None


def check_model(model: nn.Module, size: int, layers: Optional[str] = None) -> ModelPositions:
    """Refuses, before anything is changed, a model sharded attention cannot serve (``layers``:
    the path of its stack of layers, where a convolution over the sequence is refused); returns how
    it counts its positions (``positions.ModelPositions``). Called on the whole model: every
    pipeline rank decides alike."""
    where = f"torchpp.parallelize: cp={size}: {type(model).__name__}"
    own = own_attention_modules(model)
    positions = ModelPositions()
    decide_positions(model, where, positions, alibi=counts_keys_by_index(own),
                     splits_packed_rows=splits_packed_rows(own))
    modeling = sys.modules.get(type(model).__module__)
    recurrent = defines_delta_rule(modeling) or defines_mamba2(modeling) or defines_selective_scan(modeling) \
        or defines_rwkv(modeling) or defines_mlstm(modeling)
    # (Delta-rule and Mamba hybrids run attention through transformers' functions and their other
    # layers through torchpp's sharded recurrences; a layer doing neither raises at its first forward.
    # Decided by the model's modeling module: every pipeline rank decides alike, whichever layers it holds.)
    # A model that does not declare attention backends is served when its modeling module routes
    # attention through transformers' functions and it is given its positions (each layer calling
    # attention is then checked at the first forward).
    if not getattr(type(model), "_supports_attention_backend", True) and not recurrent:
        if not hasattr(modeling, "ALL_ATTENTION_FUNCTIONS") and not own:
            raise NotImplementedError(f"{where} does not run its attention through transformers' attention "
                                      f"functions (attention in its own code, such as Bloom's ALiBi), so sharded "
                                      f"attention cannot replace it")
        refused = own_refusal(own, model.config)
        if refused:
            raise NotImplementedError(f"{where} {refused}")
        # (A decoder counting its own positions is served when it hands them to embed_positions: positions.py.)
        if "position_ids" not in inspect.signature(model.forward).parameters and not positions.from_length:
            raise NotImplementedError(f"{where} takes no position_ids: it counts its positions from the length of "
                                      f"its input in its own code, which on a shard of the sequence would start "
                                      f"again at 0")
    indexed = indexed_refusal(model) if defines_indexed_attention(model) else ""
    if indexed:
        raise NotImplementedError(f"{where}'s layers of type 'indexed_attention' use {indexed}, which sharded "
                                  f"attention does not implement")
    biased = relative_bias_refusal(model)
    if biased:
        raise NotImplementedError(f"{where} {biased}")
    compressed = compressed_refusal(model) if defines_compressed_attention(model) else ""
    if compressed:
        raise NotImplementedError(f"{where}'s compressed-attention layers use {compressed}, which sharded "
                                  f"attention does not implement")
    for config in attention_configs(model).values():
        unsharded = sorted(set(getattr(config, "layer_types", None) or ()) & set(UNSHARDED_MASKS))
        if unsharded:
            raise NotImplementedError(f"{where}'s layers of type {unsharded[0]!r} use {UNSHARDED_MASKS[unsharded[0]]}, "
                                      f"which sharded attention does not implement")
        dropout = float(getattr(config, "attention_dropout", 0.0) or 0.0)
        if dropout:
            raise ValueError(f"torchpp.parallelize: cp={size} needs attention_dropout=0 (the model's config has "
                             f"{dropout}): sharded attention has no dropout")
    haloed = {id(conv) for module in model.modules() for conv in halo_convs(module)}
    haloed |= {id(conv) for conv in (delta_rule_convs(model) + mamba2_convs(model) + selective_scan_convs(model)
                                     + recurrent_block_convs(model))}
    for name, module in model.named_modules():
        if layers is not None and name.startswith(f"{layers}.") and isinstance(module, nn.Conv1d) \
                and module.kernel_size[0] > 1 and id(module) not in haloed:
            raise NotImplementedError(f"{where}: {name} convolves over the sequence (kernel {module.kernel_size[0]}), "
                                      f"which reads across the edges of a shard of the sequence")
    return positions


def check_all_to_all_heads(model: nn.Module, tp: int, cp: int, mode: str = "all-to-all") -> None:
    """All-to-all attention gives each of its cp ranks (an all-to-all group's, in mode
    all-to-all+ring) 1/cp of a tensor-parallel rank's query heads: refuses a head count (the text
    config's, where it holds one) that tp x cp does not divide, when the model is wrapped rather
    than at its first forward (the op refuses any other count then)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    try:
        heads = getattr(config, "num_attention_heads", None)
    except Exception:  # noqa: BLE001 - a count per layer (transformers' heterogeneous configs): the op checks each
        heads = None
    if isinstance(heads, int) and heads % (tp * cp):
        ranks = f"cp={cp}" if mode == "all-to-all" else f"cp_all_to_all_size={cp}"
        raise ValueError(f"torchpp.parallelize: cp_mode={mode!r} gives each of the {ranks} ranks 1/{cp} of a "
                         f"tensor-parallel rank's query heads, but num_attention_heads={heads} over tp={tp} leaves "
                         f"{heads / tp:g} per tp rank, which {ranks} does not divide; use cp_mode='ring' or "
                         f"'all-gather'")


def attention_configs(model: nn.Module) -> Dict[int, object]:
    return {id(c): c for c in [model.config] + [getattr(m, "config", None) for m in model.modules()]
            if c is not None and hasattr(c, "_attn_implementation")}


# Tensors an attention call may carry that do not change what it computes (the loss's keywords
# travel with every layer's); any other would be ignored by sharded attention (Inkling's relative
# position bias, flash kernels' packed offsets).
UNREAD_TENSORS = ("cache_position", "labels", "num_items_in_batch", "shift_labels")


# Modules calling the attention function across depth, not the sequence: each token's learned
# queries over its own earlier blocks' states (Inkling 2's attention residuals). They run as the
# model's eager attention would, on each token alone.
DEPTH_ATTENTION = ("modeling_inkling2.Inkling2BlockAttentionResidual",
                   "modeling_inkling2_loop.Inkling2LoopBlockAttentionResidual",
                   "modeling_inkling2_loop.Inkling2LoopMessageAttentionResidual")


def attends_over_depth(module: nn.Module) -> bool:
    return named_in(module, DEPTH_ATTENTION)


# Where a decoder layer keeps its attention to an encoder's states (BART's, BERT's, Whisper's).
CROSS_ATTENTION_NAMES = ("encoder_attn", "crossattention", "cross_attn")


def mark_cross_attention(model: nn.Module) -> None:
    for name, module in model.named_modules():
        if name.rpartition(".")[2] in CROSS_ATTENTION_NAMES:
            module._torchpp_cross_attention = True


def masked_causally(module: nn.Module) -> bool:
    """Whether a module's attention is causal: its own ``is_causal``, or a decoder's self-attention,
    which transformers masks causally whatever its module says (BigBirdPegasus's declares False)."""
    return bool(getattr(module, "is_causal", True)) or (
        bool(getattr(getattr(module, "config", None), "is_decoder", False))
        and not getattr(module, "_torchpp_cross_attention", False))


def check_call(module: nn.Module, query, key, attention_mask, dropout, sliding_window, causal: bool, kwargs) -> None:
    """Refuses an attention call asking for what sharded attention does not implement."""
    name = type(module).__name__
    if getattr(module, "_torchpp_cross_attention", False):
        raise NotImplementedError(f"{PREFIX}: {name} attends to an encoder's states (cross-attention), which "
                                  f"sharded attention does not place in the sequence; run the decoder alone")
    if key.size(2) != query.size(2):
        raise NotImplementedError(f"{PREFIX}: {name} attends {query.size(2)} queries of this rank's shard to "
                                  f"{key.size(2)} keys: it adds key/value entries of its own, which sharded attention "
                                  f"cannot place in the sequence")
    if dropout:
        raise NotImplementedError(f"{PREFIX}: {name} asks for attention dropout {dropout}, which sharded attention "
                                  f"does not implement")
    if attention_mask is not None:  # transformers builds none under cp: the model made its own
        raise NotImplementedError(f"{PREFIX}: {name} is given an attention mask it built itself "
                                  f"({type(attention_mask).__name__} {tuple(getattr(attention_mask, 'shape', ()))}), "
                                  f"which sharded attention cannot apply to a shard of the sequence")
    extra = sorted(key for key, value in kwargs.items() if isinstance(value, torch.Tensor) and key not in UNREAD_TENSORS)
    if extra:
        raise NotImplementedError(f"{PREFIX}: {name} passes {', '.join(extra)} to its attention function (a bias or "
                                  f"mask of its own), which sharded attention does not implement")
    kind = layer_type(module)
    if kind in UNSHARDED_MASKS:
        what = UNSHARDED_MASKS[kind]
        raise NotImplementedError(f"{PREFIX}: {name} (layer type {kind!r}) uses {what}, which sharded attention "
                                  f"does not implement")
    if sliding_window is not None and not isinstance(sliding_window, int):
        raise NotImplementedError(f"{PREFIX}: {name} asks for a sliding window {sliding_window!r}; sharded attention "
                                  f"slides a window of one int")
    if sliding_window is not None and not causal and bidirectional_window(module) is None:
        raise NotImplementedError(f"{PREFIX}: {name} asks for a sliding window {sliding_window} on bidirectional "
                                  f"attention whose mask its model builds itself (not with transformers' "
                                  f"create_bidirectional_sliding_window_mask): sharded attention slides symmetric "
                                  f"windows, |i - j| <= config.sliding_window, alone")


def bidirectional_window(module: nn.Module) -> Optional[int]:
    """The window (``attention``'s: |i - j| < window) of a bidirectional sliding-window layer whose
    model masks it with transformers' create_bidirectional_sliding_window_mask (|i - j| <=
    config.sliding_window, whatever value the module hands its attention function: EmbeddingGemma2
    and Ultrabert pass config.sliding_window + 1, T5Gemma the value itself), or None."""
    modeling = sys.modules.get(type(module).__module__)
    sliding = getattr(getattr(module, "config", None), "sliding_window", None)
    if not isinstance(sliding, int) or not hasattr(modeling, "create_bidirectional_sliding_window_mask"):
        return None
    return sliding + 1


# Layer kinds (a config's layer_types entry, or a block's block_type) that mix no tokens: an MLP or
# MoE block alone (Nemotron-H's), which a shard runs as the whole sequence would.
TOKENWISE_LAYERS = ("mlp", "moe")


class AttentionCalls:
    """Counts a model's sharded sequence-mixing calls (attention, short convolutions with halos,
    delta-rule and Mamba scans), so that each layer of its stack can be checked to have made one.
    Compiled code counts nothing: a count read there becomes a guard on its value, recompiling the
    layer at every call. So layers are judged in eager forwards, until a call is made in compiled
    code (whose calls the count would miss)."""

    def __init__(self):
        self.count = 0
        self.compiled = False  # a call was made in compiled code: not counted, so no layer is judged

    def made(self) -> None:
        """One sharded sequence-mixing call."""
        if torch.compiler.is_compiling():
            self.compiled = True  # (a store, no read: no guard)
        else:
            self.count += 1

    def watch(self, layers: nn.ModuleList, path: str) -> None:
        for index, layer in enumerate(layers):
            kind = getattr(layer, "block_type", None) or layer_type(layer)
            # (Another pipeline rank's layers are placeholders here; the recompute pass applies cp again.)
            if not getattr(layer, "placeholder", False) and not getattr(layer, "_torchpp_cp_watched", False) \
                    and kind not in TOKENWISE_LAYERS:
                layer.register_forward_pre_hook(self._before)
                layer.register_forward_hook(self._after(f"{path}.{index}"))
                layer._torchpp_cp_watched = True

    def _before(self, layer, args):
        if not torch.compiler.is_compiling():
            layer._torchpp_cp_calls_before = self.count

    def _after(self, where: str):
        def hook(layer, args, output):
            if torch.compiler.is_compiling() or self.compiled:
                return
            if self.count == getattr(layer, "_torchpp_cp_calls_before", self.count - 1):
                raise NotImplementedError(f"{PREFIX}: layer {where} ({type(layer).__name__}) ran without calling "
                                          f"attention: it mixes the sequence in its own code (a Mamba, convolution "
                                          f"or recurrent layer), which cannot run on a shard of the sequence")
        return hook
