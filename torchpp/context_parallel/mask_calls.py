"""Whether a model's masks tell packed rows apart: transformers' mask functions split a row into
sequences where its position ids restart only when the model hands them its position ids (with no
padding mask and no cache), and some models' forwards do not (GPT-OSS's). Under cp transformers
builds no mask, so the model's calls to those functions are watched: in a forward whose mask
functions were all called without position ids, sharded attention does not split rows either, as
the unwrapped model's masks do not. A forward calling none (a model building no mask) is not judged.
"""
from __future__ import annotations

import functools
import inspect
import sys
from typing import Callable, Dict, Optional

from torch import nn

MASK_FUNCTIONS = ("create_causal_mask", "create_sliding_window_causal_mask", "create_chunked_causal_mask",
                  "create_bidirectional_mask", "create_bidirectional_sliding_window_mask")

# Of the latest forward of a model transformers wrote: whether one of its mask calls got position
# ids (None: no mask call yet). Forwards run one at a time in a process.
_CALLS: Dict[str, Optional[bool]] = {"with_positions": None}


def _watched(create: Callable) -> Callable:
    signature = inspect.signature(create)

    @functools.wraps(create)
    def call(*args, **kwargs):
        given = signature.bind_partial(*args, **kwargs).arguments.get("position_ids") is not None
        _CALLS["with_positions"] = bool(_CALLS["with_positions"]) or given
        return create(*args, **kwargs)
    call._torchpp_watched = True
    return call


def _new_forward(module, args):
    _CALLS["with_positions"] = None


def watch_mask_calls(model: nn.Module) -> None:
    """Wraps the mask functions the modeling modules of ``model`` call (once per module) and resets
    the record at the start of each forward of its transformers models."""
    from transformers import PreTrainedModel

    for modeling in {sys.modules[type(m).__module__] for m in model.modules()}:
        for name in MASK_FUNCTIONS:
            create = getattr(modeling, name, None)
            if callable(create) and not getattr(create, "_torchpp_watched", False):
                setattr(modeling, name, _watched(create))
    for module in model.modules():
        if isinstance(module, PreTrainedModel) and not getattr(module, "_torchpp_resets_mask_calls", False):
            module.register_forward_pre_hook(_new_forward)
            module._torchpp_resets_mask_calls = True


def masks_split_rows() -> bool:
    """False where this forward's mask functions were called, none of them with position ids."""
    return _CALLS["with_positions"] is not False
