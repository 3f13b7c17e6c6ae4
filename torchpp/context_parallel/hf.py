"""Context parallelism for a transformers model, wrapped in place (``parallelize(model, cp=)``).

Every rank of a context-parallel group is given the same full batch, as tensor-parallel ranks
are; ``shard_batch`` keeps this rank's shard of the sequence (zigzag or contiguous chunks):
the tokens, their global positions (which the model's rotary tables or position embeddings
read, so nothing in the model changes), and the targets, shifted on the full sequence first
(token t's target is token t+1, which may live on another rank). The model's attention
function becomes ``torchpp_cp``, which runs torchpp.context_parallel.attention on each
layer's local queries, keys and values; transformers builds no mask for it (the op masks
causally by global position). Packed sequences come from position ids that restart: a token's
sequence starts at its global index minus its position id, which the attention function turns
into segment ids.

Each rank's loss is its tokens' loss sum over the whole batch's labelled tokens, so summing
gradients over cp (``DistributedOptimizer`` reduces over Megatron's dp-cp group) gives the
full-batch gradient; the loss a caller sees is the sum over cp (the batch mean).
"""
from __future__ import annotations

import inspect
import sys
import weakref
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from torchpp import recompute
from torchpp.context_parallel import LAYOUTS, MODES, attention, sequence_positions, shard_sequence
from torchpp.context_parallel.delta_rule import apply_delta_rule
from torchpp.context_parallel import compressed, dynamic_mask, indexed, relative_bias
from torchpp.context_parallel.halo import apply_halos
from torchpp.context_parallel.lightning import apply_lightning
from torchpp.context_parallel.mamba import apply_mamba2
from torchpp.context_parallel.mask_calls import masks_split_rows, watch_mask_calls
from torchpp.context_parallel.own_attention import apply_own_attention
from torchpp.context_parallel.positions import ModelPositions, apply_positions, check_given
from torchpp.context_parallel.rg_lru import apply_rg_lru
from torchpp.context_parallel.mlstm import apply_mlstm
from torchpp.context_parallel.rwkv import apply_rwkv
from torchpp.context_parallel.selective_scan import apply_selective_scan
from torchpp.context_parallel.hf_support import (AttentionCalls, attends_over_depth, attention_configs,
                                                bidirectional_window, check_call, layer_type, mark_cross_attention,
                                                masked_causally)

IGNORE_INDEX = -100
ATTENTION_NAME = "torchpp_cp"


@dataclass(frozen=True)
class ContextParallel:
    """What a context-parallel model (and each of its attention modules) holds."""

    group: dist.ProcessGroup
    mode: str = "ring"
    layout: str = "zigzag"
    # mode "all-to-all+ring": (all-to-all group, ring group) inside `group` (hierarchical_groups)
    hierarchical: Optional[Tuple[dist.ProcessGroup, dist.ProcessGroup]] = field(default=None, compare=False,
                                                                              hash=False, repr=False)
    calls: AttentionCalls = field(default_factory=AttentionCalls, compare=False, hash=False, repr=False)
    # The position ids the latest layer was called with, for attention modules their layer does not
    # give them to (Llama 4's, GPT-BigCode's): packed rows are told apart by them.
    layer_positions: Dict[str, torch.Tensor] = field(default_factory=dict, compare=False, hash=False, repr=False)
    # How the model counts its positions, when it does so itself (RoBERTa's, BART's decoders).
    model_positions: ModelPositions = field(default_factory=ModelPositions, compare=False, hash=False, repr=False)

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"torchpp.parallelize: cp_mode must be one of {MODES}, got {self.mode!r}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"torchpp.parallelize: cp_layout must be one of {LAYOUTS}, got {self.layout!r}")
        if (self.mode == "all-to-all+ring") != (self.hierarchical is not None):
            raise ValueError("torchpp context parallelism: mode 'all-to-all+ring' and its (all-to-all, ring) groups "
                             "come together")

    @property
    def attention_group(self):
        """What attention's ``group`` takes: the cp group, or all-to-all+ring's pair of groups."""
        return self.hierarchical if self.hierarchical is not None else self.group

    @property
    def size(self) -> int:
        return self.group.size()

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        return shard_sequence(x, self.group, dim=dim, layout=self.layout)

    def positions(self, seq_len: int, device: torch.device) -> torch.Tensor:
        """[s_local] global indices of this rank's tokens."""
        return sequence_positions(seq_len, self.group, self.layout, device=device)

    def sum_over_ranks(self, loss: torch.Tensor) -> torch.Tensor:
        """The sum over cp of this rank's part of a loss, keeping this rank's gradient path."""
        total = loss.detach().clone()
        dist.all_reduce(total, group=self.group)
        return loss + (total - loss.detach())


def shifted_targets(labels: torch.Tensor) -> torch.Tensor:
    """transformers' causal-LM targets on the full sequence: label t+1 for token t, -100 for the last."""
    return torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]


BATCH_FIELDS = ("rows", "sequence length", "tokens", "position ids", "labels")


def _check_same_batch(cp: ContextParallel, tokens: torch.Tensor, position_ids, labels) -> None:
    """Every cp rank must hold the same full batch (a data loader sharding over all ranks instead
    of over data-parallel replicas breaks that): ranks given different rows would exchange
    unrelated keys, or wait on each other's collectives when their shapes or packing differ.
    One small all-reduce of the batch's fingerprint; every rank raises on a mismatch."""
    sums = [t.detach().sum(dtype=torch.float64) if t is not None else tokens.new_zeros((), dtype=torch.float64)
            for t in (tokens, position_ids, labels)]
    shape = torch.tensor([float(tokens.shape[0]), float(tokens.shape[1])], dtype=torch.float64, device=tokens.device)
    fingerprint = torch.cat([shape, torch.stack(sums)])
    extremes = torch.cat([fingerprint, -fingerprint])
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=cp.group)
    highest, lowest = extremes[:fingerprint.numel()], -extremes[fingerprint.numel():]
    differ = [name for name, hi, lo in zip(BATCH_FIELDS, highest.tolist(), lowest.tolist()) if hi != lo]
    if differ:
        raise ValueError(f"torchpp context parallelism: the ranks of cp group {dist.get_process_group_ranks(cp.group)} "
                         f"were given different batches (their {', '.join(differ)} differ; this rank's "
                         f"{tuple(tokens.shape[:2])} rows x tokens); each rank of a cp group takes its data-parallel "
                         f"replica's whole batch, the same on every one of them")


def shard_batch(cp: ContextParallel, *, input_ids=None, inputs_embeds=None, labels=None, shift_labels=None,
                position_ids=None, attention_mask=None) -> Dict[str, torch.Tensor]:
    """This rank's shard of a full batch given to every rank of the cp group.

    Returns the keyword arguments for the model: ``input_ids`` or ``inputs_embeds``,
    ``position_ids`` (global positions, or the given ones' shard), and with labels, ``labels`` and
    ``shift_labels`` (the shifted targets' shard) and ``num_items_in_batch`` (the whole batch's
    labelled tokens, so each rank's loss is its part of the batch mean).

    Raises:
        ValueError: on every rank, when the cp ranks were given different batches; when an
            attention mask holds padding (pack sequences with position ids instead), or the
            sequence length is not divisible into the layout's chunks.
    """
    tokens = input_ids if input_ids is not None else inputs_embeds
    if tokens is None:
        raise ValueError("torchpp context parallelism: the model needs input_ids or inputs_embeds")
    if attention_mask is not None and not bool(attention_mask.bool().all()):
        raise ValueError("torchpp context parallelism: attention_mask holds padding (zeros), which sharded attention "
                         "does not mask; pack sequences into rows and give position_ids that restart at each one")
    if not torch.compiler.is_compiling():
        _check_same_batch(cp, tokens, position_ids, labels if labels is not None else shift_labels)
    batch, seq_len = tokens.shape[0], tokens.shape[1]
    out: Dict[str, torch.Tensor] = {}
    if input_ids is not None:
        out["input_ids"] = cp.shard(input_ids)
    else:
        out["inputs_embeds"] = cp.shard(inputs_embeds)
    rule = cp.model_positions.rule
    if position_ids is None and rule is not None:  # the model's own positions, derived from the whole sequence
        full_positions = rule(input_ids, inputs_embeds).expand(batch, -1)
        out["position_ids"] = cp.shard(full_positions)
        _mark_packing(cp, full_positions, out["position_ids"])
    elif position_ids is None:
        out["position_ids"] = cp.positions(seq_len, tokens.device).expand(batch, -1)
        setattr(out["position_ids"], ROWS_PACKED, False)  # one sequence a row
    else:
        check_given(cp.model_positions, position_ids)
        out["position_ids"] = cp.shard(position_ids.expand(batch, -1))
        _mark_packing(cp, position_ids.expand(batch, -1), out["position_ids"])
    if labels is not None or shift_labels is not None:
        targets = shift_labels if shift_labels is not None else shifted_targets(labels)
        local = cp.shard(targets)
        out.update(labels=local, shift_labels=local,
                   num_items_in_batch=(targets != IGNORE_INDEX).sum().clamp(min=1))
    return out


# id(ContextParallel) -> (the position ids last decided on, their version, the segment ids or None)
_SEGMENTS_DECIDED: Dict[int, tuple] = {}
# Set by shard_batch on the position ids it returns: whether their rows are packed. An attribute of
# the tensor, so compiled layers guard on its value (two graphs at most) and recompile for no new batch.
ROWS_PACKED = "_torchpp_rows_packed"


def _mark_packing(cp: ContextParallel, full_positions: torch.Tensor, local_positions: torch.Tensor) -> None:
    """Whether rows are packed, decided where every cp rank holds them whole: no collective, and no
    data-dependent branch in the attention layers (which broke a compiled layer's graph)."""
    if cp.model_positions.packed_rows:
        starts = torch.arange(full_positions.size(-1), device=full_positions.device) - full_positions
        setattr(local_positions, ROWS_PACKED, bool((starts != starts[..., :1]).any()))


def _segment_ids(cp: ContextParallel, position_ids: Optional[torch.Tensor], local_len: int) -> Optional[torch.Tensor]:
    """Packed sequences' ids (each token's sequence start: its global index minus its position),
    or None when each row holds one sequence or the model does not split rows by position ids.
    Position ids from ``shard_batch`` say which; for others it is decided by a collective over the
    cp group, once per position ids tensor (every layer of a forward gets the same one), or, in
    compiled code, the segment ids are given whatever the rows (correct for any, masked block by block)."""
    if position_ids is None or not cp.model_positions.packed_rows or not masks_split_rows():
        return None
    packed = getattr(position_ids, ROWS_PACKED, None)
    if packed is None and not torch.compiler.is_compiling():
        return _segment_ids_agreed(cp, position_ids, local_len)
    if packed is False:
        return None
    return cp.positions(local_len * cp.size, position_ids.device) - position_ids


def _segment_ids_agreed(cp: ContextParallel, position_ids: torch.Tensor, local_len: int) -> Optional[torch.Tensor]:
    decided = _SEGMENTS_DECIDED.get(id(cp))
    if decided is not None and decided[0]() is position_ids and decided[1] == position_ids._version:
        return decided[2]
    starts = cp.positions(local_len * cp.size, position_ids.device) - position_ids
    # The op exchanges segment ids with the keys and values, so every cp rank must pass them or
    # none: a rank whose chunks hold one sequence may pair with one whose chunks hold a boundary.
    packed = (starts != starts[..., :1]).any().to(torch.int32).reshape(1)
    dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=cp.group)
    result = starts if bool(packed) else None
    _SEGMENTS_DECIDED[id(cp)] = (weakref.ref(position_ids), position_ids._version, result)
    return result


def _record_positions(cp: ContextParallel):
    def hook(module, args, kwargs):
        if isinstance(kwargs.get("position_ids"), torch.Tensor):
            cp.layer_positions["latest"] = kwargs["position_ids"]
    return hook


def _chunk_ids(cp: ContextParallel, segments: Optional[torch.Tensor], position_ids: Optional[torch.Tensor],
               query: torch.Tensor, chunk: int) -> torch.Tensor:
    """Segment ids of chunked attention (Llama 4's: query i sees keys j <= i of its chunk of
    ``chunk`` tokens): chunks by index in the row, or, on packed rows, by position in each
    sequence (as transformers' mask remaps them), one id per (sequence, chunk)."""
    local_len = query.size(2)
    if segments is None:
        return (cp.positions(local_len * cp.size, query.device) // chunk).expand(query.size(0), -1)
    return segments * (local_len * cp.size // chunk + 1) + position_ids.expand_as(segments) // chunk


def _gathered_route(cp: ContextParallel, module: nn.Module, kwargs: dict):
    """The attention over gathered keys (``gathered``) a call needs, as a function of (query, key,
    value, mask, scaling, sinks, position ids), or None: keys an indexer chooses (``indexed``), a mask
    the model builds from per-key biases (``dynamic_mask``), relative position biases
    (``relative_bias``), compressed entries of the model's own (``compressed``). Pops what it reads
    of the call's keywords."""
    indices = kwargs.pop("indices", None)
    if indices is not None or layer_type(module) == indexed.LAYER_TYPE:
        return lambda q, k, v, mask, scaling, sinks, positions: indexed.attend(cp, module, q, k, v, mask, indices,
                                                                               scaling, sinks)
    if dynamic_mask.builds_dynamic_mask(module):
        return lambda q, k, v, mask, scaling, sinks, positions: dynamic_mask.attend(cp, module, q, k, v, mask, scaling)
    if isinstance(kwargs.get("position_bias"), torch.Tensor):
        bias, own_sinks = kwargs.pop("position_bias"), kwargs.pop("sinks", None)
        return lambda q, k, v, mask, scaling, sinks, positions: relative_bias.attend(
            cp, module, q, k, v, mask, bias, scaling, sinks if own_sinks is None else own_sinks, positions)
    if layer_type(module) in compressed.LAYER_TYPES:
        return lambda q, k, v, mask, scaling, sinks, positions: compressed.attend(cp, module, q, k, v, mask, scaling,
                                                                                  sinks, positions)
    return None


def _attention(module: nn.Module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
               sliding_window=None, softcap=None, position_ids=None, s_aux=None, alibi_slopes=None, **kwargs):
    """transformers' attention-function interface over torchpp.context_parallel.attention: causal
    (or not, by the module's ``is_causal``), sliding windows, attention sinks, capped scores and
    Llama 4's chunked layers (and ALiBi slopes, from own_attention's adapters); packed rows told
    apart by their position ids. Layers reaching keys beyond the shard attend over gathered keys
    (``_gathered_route``). What it cannot shard raises."""
    if attends_over_depth(module):  # (no token mixing: the model's own eager attention, token by token)
        own = sys.modules[type(module).__module__].eager_attention_forward
        return own(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    cp: Optional[ContextParallel] = getattr(module, "torchpp_cp", None)
    if cp is None:
        raise RuntimeError(f"torchpp context parallelism: {type(module).__name__} was not wrapped by "
                           f"parallelize(..., cp=)")
    causal = kwargs.pop("is_causal", None)  # a call's own is_causal wins over its module's, as in transformers'
    causal = masked_causally(module) if causal is None else causal
    if position_ids is None:
        position_ids = cp.layer_positions.get("latest")
    gathered = _gathered_route(cp, module, kwargs)
    if gathered is not None:  # (its keys' length and mask are the route's own to check)
        check_call(module, query, query, None, dropout, sliding_window, causal, kwargs)
        cp.calls.made()
        return gathered(query, key, value, attention_mask, scaling, s_aux, position_ids), None
    check_call(module, query, key, attention_mask, dropout, sliding_window, causal, kwargs)
    cp.calls.made()
    segments = _segment_ids(cp, position_ids, query.size(2))
    if layer_type(module) == "chunked_attention":
        segments = _chunk_ids(cp, segments, position_ids, query, module.config.attention_chunk_size)
    if sliding_window is not None and not causal:  # (the model's mask's window, not the one it passes)
        sliding_window = bidirectional_window(module)
    out = attention(query, key, value, cp.attention_group, causal=causal, scale=scaling, mode=cp.mode,
                    layout=cp.layout, segment_ids=segments, window=sliding_window, sinks=s_aux, softcap=softcap,
                    alibi_slopes=alibi_slopes)
    return out.transpose(1, 2).contiguous(), None


def _recomputed_attention(module, *args, **kwargs):
    # Selective recompute: the exchange and the blocks run again in backward; nothing s x s is kept.
    return recompute.checkpoint(_attention, module, *args, **kwargs)


def _register(recompute_core: bool) -> str:
    # No mask function under this name: transformers then builds no mask (the op masks by position).
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = ATTENTION_NAME + ("_recompute" if recompute_core else "")
    if name not in ALL_ATTENTION_FUNCTIONS:
        ALL_ATTENTION_FUNCTIONS.register(name, _recomputed_attention if recompute_core else _attention)
    return name


def apply_context_parallel(model: nn.Module, cp: ContextParallel, recompute_core: bool,
                           layers: Optional[str] = None) -> None:
    """Routes every attention call of a transformers ``model`` (this rank's stages of it) through
    sharded attention over ``cp``; each layer of the stack at path ``layers`` must then call it
    (``hf_support.AttentionCalls``). ``hf_support.check_model`` has run on the whole model, before
    any pipeline cut, and ``cp`` carries the positions it decided (``model_positions``).
    """
    name = _register(recompute_core)
    # (own-code adapters first: they read which of transformers' paths the model takes, which can differ)
    apply_own_attention(model, _recomputed_attention if recompute_core else _attention)
    for config in attention_configs(model).values():
        config._attn_implementation = name
    if layers is not None:
        cp.calls.watch(model.get_submodule(layers), layers)
    apply_positions(model, cp)
    watch_mask_calls(model)
    indexed.apply_indexed_attention(model, cp)
    compressed.apply_compressed_attention(model, cp)
    relative_bias.apply_relative_biases(model, cp)
    dynamic_mask.apply_dynamic_masks(model, cp)
    mark_cross_attention(model)
    apply_halos(model, cp)
    apply_delta_rule(model, cp)
    apply_mamba2(model, cp)
    apply_selective_scan(model, cp)
    apply_rg_lru(model, cp)
    apply_rwkv(model, cp)
    apply_mlstm(model, cp)
    apply_lightning(model, cp)
    record = _record_positions(cp)
    for module in model.modules():  # the attention function gets its module: each one knows the group
        if next(module.parameters(), None) is None:
            continue  # (a module without weights may be shared with other models: OpenAI GPT's activations)
        module.torchpp_cp = cp
        if "position_ids" in inspect.signature(module.forward).parameters and \
                not getattr(module, "_torchpp_records_positions", False):  # (the recompute pass applies this again)
            module.register_forward_pre_hook(record, with_kwargs=True)
            module._torchpp_records_positions = True
