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
        reshard_after_forward: also release the buckets after each forward (every microbatch)
            and gather them again when backward reaches the module's outputs (FSDP2's option of
            that name): less memory between a microbatch's forward and backward, at the price
            of a gather per module per forward and per backward instead of one per step.
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
            handles.append(module.register_forward_hook(_release_until_backward(optimizer, own, buckets, running)))
    return handles


def _release_until_backward(optimizer, own, buckets, running):
    def before_backward(grad):
        optimizer.gather_params_of(own)  # the saved views see the same storage, refilled

    def release(_module, _args, output):
        for tensor in _tensors(output):
            if tensor.requires_grad:
                tensor.register_hook(before_backward)
        for flat in buckets:
            running[id(flat)] -= 1
            if running[id(flat)] == 0:
                flat.release()

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
