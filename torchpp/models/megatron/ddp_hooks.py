"""Megatron's DDP gradient hooks, fired when a split-B/W weight gradient really arrives (W).

Megatron's ``DistributedDataParallel`` hooks each parameter's AccumulateGrad node: the hook
adds ``param.grad`` into ``param.main_grad`` (and, with ``overlap_grad_reduce``, marks the
parameter ready). A split-B/W linear's I pass reaches that node without a gradient (it parked
it), and its W pass accumulates outside autograd, where no node hook runs. ``fire_node_hooks_from_w``
gates the node's hooks while a gradient of the parameter is parked and runs them again from
the W pass (torchpp's post-accumulate hook), which is also how torchpp's own DP waits for W.
"""
from __future__ import annotations

from typing import Callable, Dict, List

import torch
from torch import nn

from torchpp import _C

_GATED = "_torchpp_w_gated"


def _accumulate_grad_node(param: torch.Tensor):
    return param.expand_as(param).grad_fn.next_functions[0][0]


def _python_node_hooks(node) -> Dict[int, Callable]:
    """The dict holding a node's Python post hooks (shared by all of them; torch keeps one per
    node and hands a weak reference to it out with every handle)."""
    probe = node.register_hook(lambda *unused: None)
    hooks = probe.hooks_dict_ref()
    probe.remove()
    return hooks


def fire_node_hooks_from_w(module: nn.Module) -> int:
    """Makes the AccumulateGrad node hooks of ``module``'s parameters (Megatron DDP's) wait
    for a split-B/W weight gradient's W pass instead of running, empty, in its I pass
    (idempotent).

    Args:
        module: a model chunk, e.g. wrapped by Megatron's DistributedDataParallel.

    Returns:
        How many parameters carry such hooks.
    """
    count = 0
    for param in module.parameters():
        if not param.requires_grad or param.grad_fn is not None:
            continue
        node = _accumulate_grad_node(param)
        hooks = _python_node_hooks(node)
        if not hooks:
            continue
        count += 1
        if getattr(param, _GATED, False):
            continue
        originals: List[Callable] = list(hooks.values())

        def gate(hook: Callable, param=param) -> Callable:
            def gated(*args):
                # I parked this parameter's gradient: the hook runs when W delivers it.
                if _C.wgrad_parked_for(param) > 0 and not _C.wgrad_in_deferred_accumulate():
                    return None
                return hook(*args)
            return gated

        for key in list(hooks):
            hooks[key] = gate(hooks[key])

        def from_w(tensor: torch.Tensor, originals=originals) -> None:
            if _C.wgrad_in_deferred_accumulate():
                for hook in originals:
                    hook((), (tensor.grad,))

        param.register_post_accumulate_grad_hook(from_w)
        # The node carries the hooks: keep it alive as long as the parameter.
        param._torchpp_grad_acc = node
        setattr(param, _GATED, True)
    return count
