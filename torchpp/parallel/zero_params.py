"""ZeRO-3's just-in-time parameter gathers, and the one reading of a ``zero=`` argument.

Each module that owns parameters directly gets a forward pre-hook that gathers the buckets
holding them (a no-op when they are gathered already). Under a pipeline the first microbatch's
forward gathers a stage's buckets and the later microbatches find them gathered: one all-gather
per bucket per step, released when the bucket's gradient is reduce-scattered after its last
backward (or W) pass. Recomputation re-runs the forward inside backward, before that release.
"""
from __future__ import annotations

from typing import List, Union

import torch

ZERO_STAGES = (0, 1, 2, 3)


def zero_stage(zero: Union[bool, int]) -> int:
    """The ZeRO stage named by ``zero``: False -> 0, True -> 1, or the int 0..3 itself."""
    if isinstance(zero, bool):
        return int(zero)
    if isinstance(zero, int) and zero in ZERO_STAGES:
        return zero
    raise ValueError(f"torchpp: zero must be one of {ZERO_STAGES} (or True for 1, False for 0), got {zero!r}")


def gather_before_forward(model: torch.nn.Module, optimizer,
                          reshard_after_forward: bool = False) -> List[torch.utils.hooks.RemovableHandle]:
    """Registers, on every module of ``model`` that owns parameters, a forward pre-hook that
    gathers those parameters' buckets from ``optimizer`` (a ZeroRedundancyOptimizer built
    with shard_params). Returns the hook handles.

    Args:
        reshard_after_forward: also release the buckets after each forward (every microbatch),
            gather them again when backward reaches the module's outputs and release them once
            its inputs' gradients are computed (FSDP2's option of that name): less memory, at
            the price of a gather per module per forward and per backward instead of one per
            bucket per step.
    """
    handles = []
    running = {}  # bucket -> forwards using it now (a parent's own parameters may share a child's bucket)
    for module in model.modules():
        own = [p for p in module.parameters(recurse=False) if p.requires_grad]
        if not own:
            continue
        buckets = list({id(optimizer._group_of[id(p)]): optimizer._group_of[id(p)] for p in own}.values())

        def gather(_module, _args, own=own, buckets=buckets):
            # Prefetch only in a forward proper: a forward re-run in backward (recompute) would
            # fetch a bucket whose backward is over.
            optimizer.gather_params_of(own, prefetch=torch._C._current_graph_task_id() == -1)
            if reshard_after_forward:
                for flat in buckets:
                    running[id(flat)] = running.get(id(flat), 0) + 1

        handles.append(module.register_forward_pre_hook(gather))
        if reshard_after_forward:
            handles.append(module.register_forward_hook(_release_until_backward(optimizer, own, buckets, running),
                                                        with_kwargs=True))
    return handles


def _release_until_backward(optimizer, own, buckets, running):
    """The forward hook of reshard_after_forward: releases the module's buckets, and arranges
    their gather when backward reaches the module's outputs and their release again once
    backward has produced the gradients of its inputs (its I pass: a W pass needs no weights).
    ``running`` counts, per bucket, the forwards and the backwards using it now; a bucket is
    released only when none does (buckets are shared by neighbouring modules)."""

    def use(flat_delta):
        for flat in buckets:
            running[id(flat)] = running.get(id(flat), 0) + flat_delta
            if running[id(flat)] == 0:
                flat.release()

    def release(_module, args, kwargs, output):
        outputs = [t for t in _tensors(output) if t.requires_grad]
        inputs = [t for t in _tensors((args, kwargs)) if t.requires_grad]
        call = {"in_backward": False}  # this forward call's backward (one per microbatch)

        def before_backward(grad):
            optimizer.gather_params_of(own)  # the saved views see the same storage, refilled
            if inputs and not call["in_backward"]:
                call["in_backward"] = True
                use(+1)

        def after_backward(_grads):
            if call["in_backward"]:
                call["in_backward"] = False
                use(-1)

        for tensor in outputs:
            tensor.register_hook(before_backward)
        if outputs and inputs:  # without inputs that need gradients, the reduce-scatter releases it
            torch.autograd.graph.register_multi_grad_hook(inputs, after_backward)
        use(-1)  # this forward is over

    return release


def _tensors(output):
    if torch.is_tensor(output):
        return [output]
    if isinstance(output, (tuple, list)):
        return [t for item in output for t in _tensors(item)]
    if isinstance(output, dict):
        return [t for item in output.values() for t in _tensors(item)]
    if hasattr(output, "to_tuple"):  # transformers' ModelOutput
        return _tensors(output.to_tuple())
    return []
