"""Statistics across a split width: where a model computes, between a column-split projection
and the row-split one it feeds, a statistic over the projection's whole output (a norm over all
heads at once, ESMC's q/k LayerNorm; the mean and spread of Gemma 3n's sparse activations),
each rank would compute it on its slice alone. One traced forward of the unsplit model on a
few tokens finds them (the autograd graph between the two records each reduction's dimension
and size), and that group gathers instead: its column-split projections become
``colwise_gather_output`` and the row-split one ``rowwise_split_input``, as transformers' OLMo 2
plan does by hand. Reductions within a head (per-head norms, attention's softmax over keys)
span fewer features and stay split. The same trace finds row-split projections whose input no
column-split one feeds (a plan's glob reaching a layer of another kind: GLM-5-Next's linear
attention layers share ``self_attn.o_proj`` with its full ones): they stay whole.
"""
from __future__ import annotations

from typing import Dict, List, Mapping

import torch
from torch import nn

from torchpp.models.auto_fused_qkv import FUSED_QKV_STYLES
from torchpp.models.autograd_walk import walk_back
from torchpp.models.traced_forward import traced_forward

# Fused readers split part by part feed a row split too (a group that gathers splits them plainly);
# so do those split block by block by size (``packed_colwise(a,b,...)``: Mamba 2's in_proj).
COLUMN_STYLES = ("colwise", "packed_colwise", "packed3_colwise", *FUSED_QKV_STYLES, "packed_colwise(")
ROW_STYLES = ("rowwise",)
# Autograd nodes that combine features along a dimension (not softmax: within a head, over keys).
REDUCTIONS = ("Mean", "Var", "Std", "Sum", "Norm", "Prod", "Amax", "Amin", "MaxBackward", "MinBackward", "LogsumexpBackward")


def gather_where_width_statistics(model: nn.Module, resolved: Mapping[str, str]) -> Dict[str, str]:
    """``resolved`` (full module names -> styles) with the groups that compute statistics
    across their split width gathered instead, and row-split projections nothing splits the
    input of left whole; unchanged if the model cannot run here."""
    modules = dict(model.named_modules())
    columns = [n for n, s in resolved.items()
               if (s in COLUMN_STYLES or s.startswith(COLUMN_STYLES[-1])) and isinstance(modules.get(n), nn.Linear)]
    rows = [n for n, s in resolved.items() if s in ROW_STYLES and isinstance(modules.get(n), nn.Linear)]
    if not columns or not rows or any(p.is_meta for p in model.parameters()):
        return dict(resolved)
    seen: Dict[str, tuple] = {}
    linears = [n for n, m in modules.items() if isinstance(m, nn.Linear)]  # every linear bounds the walks
    hooks = [modules[n].register_forward_hook(_record(seen, n)) for n in linears]
    try:
        traced_forward(model)
    except Exception:  # noqa: BLE001 - a model that cannot run here keeps its plan
        return dict(resolved)
    finally:
        for hook in hooks:
            hook.remove()
    outputs = {seen[n][1].grad_fn: n for n in linears if n in seen and seen[n][1].grad_fn is not None}
    owners = {id(p): name for name, module in modules.items() for p in module.parameters(recurse=False)}
    plan = dict(resolved)
    for row in rows:
        if row not in seen:
            continue
        walk = walk_back([seen[row][0]], outputs)
        reached, params = walk.reached, walk.params
        widths_reduced = {size for node in walk.nodes for size in _last_dim_reduced(node)}
        feeding = [c for c in reached if c in columns]
        widths = {modules[c].out_features for c in feeding}
        if not feeding:  # a glob reaching a layer of another kind, whose input nothing splits: keep it whole
            del plan[row]
        elif widths & widths_reduced:
            plan.update({c: "colwise_gather_output" for c in feeding})
            plan[row] = "rowwise_split_input"
            for owner in {owners[p] for p in params if p in owners}:  # they now see whole activations
                if plan.get(owner) == "replicated_with_grad_allreduce":
                    del plan[owner]
    return plan


def _record(seen, name):
    def hook(module, args, output):  # a call autograd recorded (some models run early cycles without grad)
        if isinstance(output, torch.Tensor) and output.grad_fn is not None and args[0].grad_fn is not None:
            seen.setdefault(name, (args[0], output))
    return hook


def _last_dim_reduced(node) -> List[int]:
    """Sizes of the last dimension a mean / var / std / sum / norm / layer norm node reduces."""
    shape = getattr(node, "_saved_normalized_shape", None)
    if shape:  # a layer norm over the trailing dims
        return [int(shape[-1])]
    dims = getattr(node, "_saved_dim", None)
    # Only reductions: a slice or cat over the last dim (rotary's halves of a head) keeps features apart.
    if dims is None or not any(word in type(node).__name__ for word in REDUCTIONS):
        return []
    sizes = getattr(node, "_saved_self_sym_sizes", None)
    if sizes is None:
        saved = getattr(node, "_saved_self", None)
        sizes = None if saved is None else tuple(saved.shape)
    if not sizes:
        return []
    dims = [d - 2**64 if d >= 2**63 else d for d in (dims if isinstance(dims, (tuple, list)) else (dims,))]
    last = len(sizes) - 1  # saved dims come back unsigned: -1 as 2**64 - 1
    return [int(sizes[-1])] if any(d % len(sizes) == last for d in dims if isinstance(d, int)) else []
