"""DeepSeek-V4's compressed attention on a shard of the sequence (layers of type
``heavily_compressed_attention`` and ``compressed_sparse_attention``).

Each such layer attends, in one softmax with its sinks, to the keys of its sliding window and to
compressed entries: one per window of m tokens at absolute positions (HCA: a softmax-gated sum;
CSA: overlapping windows, of which an indexer keeps each query's top k). Query t sees entry w once
its window is closed, ``w < (t + 1) // m``.

On a shard, the windows span ranks, so the compressors' (and the CSA indexer's) key and gate
projections are all-gathered (``kv_proj``, ``gate_proj``; their gradients reduce-scatter back) and
each rank's compressor then runs its own code over the whole sequence: the same entries, rotated at
the same positions, as on one process. Its queries, the indexer's scores and the causal bias over
the entries stay this rank's (its local hidden states and global position ids). The attention
module is given an empty mask, so the model hands the attention function exactly that bias; the
function gathers the sliding keys and attends to both (``gathered.masked_attention``).
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import nn

from torchpp.context_parallel.families import named_in
from torchpp.context_parallel.gathered import (call_argument, gather_keys, gathering_output, masked_attention,
                                               visible_keys, with_argument)

LAYER_TYPES = ("heavily_compressed_attention", "compressed_sparse_attention")

# Modules (by modeling module and class) whose kv_proj and gate_proj outputs are gathered; each
# checked against the unwrapped model in tests.
COMPRESSORS = (
    "modeling_deepseek_v4.DeepseekV4HCACompressor",
    "modeling_deepseek_v4.DeepseekV4CSACompressor",
    "modeling_deepseek_v4.DeepseekV4Indexer",
)
PROJECTIONS = ("kv_proj", "gate_proj")


def _known(module: nn.Module) -> bool:
    return named_in(module, COMPRESSORS)


def _compressed_attention_modules(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    from torchpp.context_parallel.hf_support import layer_type

    return [(name, module) for name, module in model.named_modules() if layer_type(module) in LAYER_TYPES
            and getattr(module, "compressor", None) is not None]


def defines_compressed_attention(model: nn.Module) -> bool:
    from torchpp.context_parallel.hf_support import attention_configs

    return any(set(LAYER_TYPES) & set(getattr(c, "layer_types", None) or ()) for c in attention_configs(model).values())


def refusal(model: nn.Module) -> str:
    """Why a model with compressed-attention layers cannot run them on a shard ('' when it can)."""
    modules = _compressed_attention_modules(model)
    unknown = sorted({type(m.compressor).__name__ for _, m in modules if not _known(m.compressor)})
    if not modules or unknown:
        return (f"compressed key/value entries from a compressor torchpp does not gather "
                f"({unknown[0] if unknown else 'none found'}; DeepSeek-V4's are served)")
    return ""


def _give_empty_mask(cp):
    # The model appends its bias over the compressed entries to a given mask: an empty one makes
    # the attention function's mask exactly that bias, [b, 1, s_local, entries].
    def hook(module, args, kwargs):
        hidden = call_argument(module.forward, args, kwargs, "hidden_states")
        mask = hidden.new_zeros(hidden.size(0), 1, hidden.size(1), 0)
        return with_argument(module.forward, args, kwargs, "attention_mask", mask)
    return hook


def apply_compressed_attention(model: nn.Module, cp) -> None:
    """Hooks this rank's compressed-attention modules (``refusal`` has passed)."""
    for _, module in _compressed_attention_modules(model):
        if getattr(module, "_torchpp_compressed", False):  # (the recompute pass applies cp again)
            continue
        module.register_forward_pre_hook(_give_empty_mask(cp), with_kwargs=True)
        for compressor in module.compressor.modules():
            if _known(compressor):
                for name in PROJECTIONS:
                    getattr(compressor, name).register_forward_hook(gathering_output(cp))
        module._torchpp_compressed = True


def attend(cp, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           entry_bias: Optional[torch.Tensor], scaling: Optional[float], sinks: Optional[torch.Tensor],
           position_ids: Optional[torch.Tensor]) -> torch.Tensor:
    """This rank's queries [b, h, s_local, d] attending to the sliding window's keys (this rank's
    first s_local of ``key``/``value``, gathered) and the compressed entries after them, under the
    model's bias over the entries (``entry_bias`` [b, 1, s_local, entries]; 0 or -inf). Returns
    [b, s_local, h, d_v]."""
    local = query.size(2)
    entries = key.size(2) - local
    if entry_bias is None or entry_bias.shape[-2:] != (local, entries):
        raise RuntimeError(f"torchpp context parallelism: {type(module).__name__}'s compressed attention was not given "
                           f"its bias over {entries} compressed entries (got "
                           f"{tuple(getattr(entry_bias, 'shape', ()))})")
    # (One check per call, before any collective: a bias with other values would need a float mask.)
    if bool(((entry_bias != 0) & (entry_bias != float("-inf"))).any()):
        raise NotImplementedError(f"torchpp context parallelism: {type(module).__name__}'s bias over its compressed "
                                  f"entries holds values other than 0 and -inf, which a mask cannot express")
    same = value is key  # (DeepSeek-V4 reads one tensor as both: gather it once)
    keys = torch.cat([gather_keys(cp, key[:, :, :local]), key[:, :, local:]], dim=2)
    values = keys if same else torch.cat([gather_keys(cp, value[:, :, :local]), value[:, :, local:]], dim=2)
    visible = visible_keys(cp, module, query.size(0), local, position_ids, query.device)
    allowed = torch.cat([visible, (entry_bias == 0).expand(visible.size(0), -1, -1, -1)], dim=-1)
    return masked_attention(query, keys, values, allowed, scaling, sinks)
