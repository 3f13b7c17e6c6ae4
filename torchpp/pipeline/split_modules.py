"""Existing layers onto the split B/W op: plain ``nn.Linear`` and ``nn.MultiheadAttention``.

A zero-bubble schedule's W pass only has work where a layer's backward defers its weight
gradient. ``split_linears(module)`` gives every plain ``nn.Linear`` inside ``module`` (any
subclass that keeps ``nn.Linear.forward``, e.g. ``nn.MultiheadAttention``'s out_proj) and
every ``nn.MultiheadAttention`` a subclass of its own class whose forward runs through
``torch.ops.torchpp.split_bw_linear``. Swapping the instance's class (rather than replacing
the module or hooking its forward) keeps its parameters, state-dict names, hooks and
``isinstance`` as they are, costs nothing per call, and undoes by swapping back.

Left alone: layers with a forward of their own (torchpp's ``SplitBWLinear`` and TP layers,
which decide their split themselves; LoRA-style subclasses), lazy and parametrized linears
(no leaf weight to defer), and any module that calls ``F.linear`` on a linear's weight itself
rather than calling the linear (``nn.MultiheadAttention`` does so, hence its own wrapper).
"""
from __future__ import annotations

import contextlib
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.lazy import LazyModuleMixin
from torch.nn.utils import parametrize

from torchpp.pipeline.split_linear import SplitBWLinear, split_bw_linear


@contextlib.contextmanager
def _split_projections(weights: List[torch.Tensor]):
    """Routes the ``linear`` calls that ``F.multi_head_attention_forward`` makes on the given
    (leaf) weights through the split op. That function looks ``linear`` up in
    torch.nn.functional's globals at each call, and a TorchFunctionMode would see the whole
    attention function as one call, not its linears: so the global is swapped for the call.
    """
    plain = F.linear

    def linear(input, weight, bias=None):
        if any(weight is w for w in weights):
            return split_bw_linear(input, weight, bias)
        return plain(input, weight, bias)

    F.linear = linear
    try:
        yield
    finally:
        F.linear = plain


class SplitBWMultiheadAttention(nn.MultiheadAttention):
    """``nn.MultiheadAttention`` whose input and output projections run the split op.

    Its own forward runs unchanged (``F.multi_head_attention_forward``); only the ``F.linear``
    calls on its projection weights inside it are routed to ``split_bw_linear``. Deferred:
    the packed ``in_proj_weight`` of self-attention (query, key and value the same tensor) and
    ``out_proj``. Cross-attention slices the packed weight per projection (not a leaf), and
    the separate q/k/v weights take slices of ``in_proj_bias``: those run ordinary backward.
    """

    def forward(self, *args, **kwargs):
        if not torch.is_grad_enabled():  # eval (and its fast path): nothing to defer
            return super().forward(*args, **kwargs)
        if torch.compiler.is_compiling():  # compiled, the weight gradients would be traced into I
            return self._split_forward_eager(*args, **kwargs)
        return self._split_forward(*args, **kwargs)

    def _split_forward(self, *args, **kwargs):
        weights = [w for w in (self.in_proj_weight, self.q_proj_weight, self.k_proj_weight, self.v_proj_weight,
                               self.out_proj.weight) if w is not None]
        with _split_projections(weights):
            return super().forward(*args, **kwargs)

    @torch.compiler.disable
    def _split_forward_eager(self, *args, **kwargs):
        return self._split_forward(*args, **kwargs)


# Each swapped class remembers the class it replaced (to swap back, and to pickle by).
_PLAIN = "_torchpp_plain_class"
_SPLIT_CLASSES: Dict[type, type] = {}


def _split_base(cls: type) -> Optional[type]:
    """The split class ``cls`` instances take on, or None when ``cls`` is not a plain layer."""
    if issubclass(cls, LazyModuleMixin):  # turns itself into its cls_to_become on first call
        return None
    if issubclass(cls, nn.Linear) and cls.forward is nn.Linear.forward:
        return SplitBWLinear
    if issubclass(cls, nn.MultiheadAttention) and cls.forward is nn.MultiheadAttention.forward:
        return SplitBWMultiheadAttention
    return None


def _split_class(cls: type, base: type) -> type:
    if cls not in _SPLIT_CLASSES:
        # cls first: its own methods and attributes stay; base's forward is the only new one.
        bases = (base,) if cls in base.__bases__ else (cls, base)
        _SPLIT_CLASSES[cls] = type(f"SplitBW{cls.__name__}", bases, {_PLAIN: cls, "__module__": __name__,
                                                                     "__reduce_ex__": _reduce_split})
    return _SPLIT_CLASSES[cls]


def _reduce_split(self, protocol):
    # A class made here cannot be found by name when unpickled: rebuild it from its plain class.
    reduced = object.__reduce_ex__(self, protocol)
    return (_new_split, (type(self)._torchpp_plain_class,)) + tuple(reduced[2:])


def _new_split(plain: type):
    cls = _split_class(plain, _split_base(plain))
    return cls.__new__(cls)


def _swappable(module: nn.Module) -> Optional[type]:
    """The split class for ``module``, or None to leave it alone."""
    cls = type(module)
    if hasattr(cls, _PLAIN) or "forward" in module.__dict__ or parametrize.is_parametrized(module):
        return None  # already split; a forward set on the instance; a computed (non-leaf) weight
    if any(_summed_by_hook(p) for p in module.parameters(recurse=False)):
        return None  # a TP plan sums its gradient in a hook on the autograd edge, which W would skip
    base = _split_base(cls)
    return None if base is None else _split_class(cls, base)


def _summed_by_hook(param: torch.Tensor) -> bool:
    # Marked by torchpp.tensor_parallel.styles: gradients summed over TP, or over a head's copies.
    return bool(getattr(param, "tp_grad_sum", None) or getattr(param, "tp_replicas", None))


def split_linears(module: nn.Module) -> List[str]:
    """Swaps every plain ``nn.Linear`` and ``nn.MultiheadAttention`` inside ``module`` (itself
    included) onto the split B/W op, in place; idempotent.

    Args:
        module: walked with ``named_modules`` (shared submodules once).

    Returns:
        The names (as in ``named_modules``) of every module that now runs the split op
        because of this call or an earlier one.
    """
    names = []
    for name, sub in module.named_modules():
        split = _swappable(sub)
        if split is not None:
            sub.__class__ = split
        if hasattr(type(sub), _PLAIN):
            names.append(name)
    return names


def unsplit_linears(module: nn.Module) -> int:
    """Undoes ``split_linears`` inside ``module``: each swapped module gets its class back.

    Args:
        module: walked with ``modules``.

    Returns:
        How many modules were swapped back.
    """
    count = 0
    for sub in module.modules():
        plain = getattr(type(sub), _PLAIN, None)
        if plain is not None:
            sub.__class__ = plain
            count += 1
    return count
