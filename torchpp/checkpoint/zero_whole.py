"""ZeRO-sharded optimizer state of parameters saved whole.

A parameter whose TP shard is not one block of the full tensor (fused blocks split block by
block, heads copied over ranks, a vocabulary padded to a multiple of tp) is saved as its full
tensor (see layout.saved_whole). Under ZeRO a rank holds only a flat segment of its TP shard's
state, which maps to scattered pieces of the full tensor; so the segments are first put back
together into the TP shard (over the ZeRO group), then gathered whole over TP.
"""
from __future__ import annotations

from typing import Dict, List, Tuple

import torch
import torch.distributed as dist

from torchpp.checkpoint.layout import WholeLayout, saved_whole
from torchpp.parallel.groups import ParallelState
from torchpp.parallel.object_collectives import all_gather_objects
from torchpp.parallel.zero import ZeroRedundancyOptimizer

# (id of the model parameter, state key) -> the full tensor of that state
WholeState = Dict[Tuple[int, str], torch.Tensor]


def _per_element_keys(inner: torch.optim.Optimizer, segment) -> Dict[str, torch.dtype]:
    """{state key: dtype} of the state shaped like the segment (Adam's moments, not its step)."""
    state = inner.state.get(segment.shard_view, {})
    return {key: value.dtype for key, value in state.items()
            if torch.is_tensor(value) and value.dim() > 0 and value.shape == segment.shard_view.shape}


def gather_whole_zero_state(optimizer, state: ParallelState) -> WholeState:
    """The full per-element state of every ZeRO-sharded parameter saved whole (collective: every
    rank of the model part calls it, in the same order; no-op without ZeRO or such parameters).

    The ZeRO group's ranks hold disjoint segments of one TP shard: each writes its own into a
    zero buffer and a sum over the group gives the shard; the TP gather then gives the tensor.
    """
    if not isinstance(optimizer, ZeroRedundancyOptimizer):
        return {}
    inner = optimizer.optimizer
    segment_of = {id(s.param): s for s in optimizer.segments}
    gathered: WholeState = {}
    for flat in optimizer.flat_groups:
        whole = [p for p in flat.params if saved_whole(p, state)]
        if not whole:
            continue
        # A rank learns the state keys of segments it does not hold from those that do.
        mine = {k: _per_element_keys(inner, segment_of[id(p)]) for k, p in enumerate(whole) if id(p) in segment_of}
        everyone: List[Dict[int, Dict[str, torch.dtype]]] = all_gather_objects(mine, flat.group)
        for k, param in enumerate(whole):
            keys = {}
            for held in everyone:
                keys.update(held.get(k, {}))
            segment, layout = segment_of.get(id(param)), WholeLayout(param, state)
            for key in sorted(keys):
                shard = torch.zeros(param.numel(), dtype=keys[key], device=flat.flat_grad.device)
                if segment is not None:
                    values = inner.state[segment.shard_view][key]
                    shard[segment.param_lo:segment.param_lo + values.numel()].copy_(values)
                dist.all_reduce(shard, group=flat.group)  # the segments are disjoint: the sum joins them
                gathered[(id(param), key)] = layout.gather(shard.view(param.shape))
    return gathered


def segment_of_whole(full: torch.Tensor, layout: WholeLayout, segment) -> torch.Tensor:
    """This rank's ZeRO segment (flat) of the TP shard that ``full`` gives under ``layout``."""
    shard = layout.shard(full).reshape(-1)
    return shard[segment.param_lo:segment.param_lo + segment.shard_view.numel()]
