"""transformers' load-balancing loss over the whole batch under data parallelism.

The loss (Switch Transformer's: E * sum_e f_e P_e, with f_e the share of routed pairs and P_e the
mean router probability of expert e) is not a mean of per-rank losses, so each rank's router
logits are all-gathered over the data-parallel ranks (dp x cp) where transformers records them:
every rank computes the full batch's aux loss, as the unwrapped model would. The gather's
backward reduce-scatters, so each rank's router gets the aux-loss gradient of its own tokens
times the number of ranks, which the data-parallel average divides back out.
"""
from __future__ import annotations

from typing import List

import torch.distributed as dist
from torch import nn

from torchpp import ops

ROUTER_LOGITS = "router_logits"


def _recording_router_logits() -> bool:
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:  # a transformers without output capturing records nothing to gather
        return False
    collected = _active_collector.get()
    return collected is not None and ROUTER_LOGITS in collected


def gather_router_logits(model: nn.Module, group: dist.ProcessGroup) -> List[object]:
    """Hooks the routers transformers records ``router_logits`` from (the modules of the model's
    ``_can_record_outputs`` entry) so that, while it records them, their logits [tokens, E] are
    all-gathered over ``group``; returns the hook handles. Every rank must hold as many tokens."""
    recorder = (getattr(type(model), "_can_record_outputs", None) or {}).get(ROUTER_LOGITS)
    if recorder is None:
        for child in model.modules():  # a causal LM's base model holds the recorder entry
            recorder = (getattr(type(child), "_can_record_outputs", None) or {}).get(ROUTER_LOGITS)
            if recorder is not None:
                break
    if recorder is None or group.size() == 1:
        return []
    target, index = getattr(recorder, "target_class", None), getattr(recorder, "index", 0)
    layer_name = getattr(recorder, "layer_name", None)

    def hook(module, args, output):
        if not _recording_router_logits():
            return None
        logits = output[index] if isinstance(output, tuple) else output
        gathered = ops.gather_from_sp_region(logits, group, dim=0)
        if isinstance(output, tuple):
            return output[:index] + (gathered,) + output[index + 1:]
        return gathered

    handles = [model.register_forward_pre_hook(_whole_rows_only(model, group.size()), with_kwargs=True)]
    for name, module in model.named_modules():
        if (target is not None and isinstance(module, target)) or (layer_name and name.endswith(layer_name)):
            handles.append(module.register_forward_hook(hook, prepend=True))
    return handles


def _whole_rows_only(model: nn.Module, ranks: int):
    """A forward pre-hook: transformers weights the load-balancing loss by the attention mask of
    this rank's rows, which the gathered logits outgrow. A mask without padding changes nothing
    and is dropped; padding is refused with the reason."""
    def hook(module, args, kwargs):
        mask = kwargs.get("attention_mask")
        config = getattr(model, "config", None)
        recording = kwargs.get("output_router_logits", getattr(config, "output_router_logits", False))
        if mask is None or not recording:
            return None
        if bool(mask.bool().all()):
            return args, {**kwargs, "attention_mask": None}
        raise NotImplementedError(
            f"torchpp: the load-balancing loss over {ranks} data-parallel ranks gathers every rank's router logits, "
            f"and transformers would weight them by this rank's padding mask alone; pack the rows without padding "
            f"(attention_mask all ones, or None)")
    return hook
