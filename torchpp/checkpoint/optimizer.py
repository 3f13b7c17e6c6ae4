"""Optimizer state as layout-independent checkpoint entries.

Each parameter's state is saved under its global name: per-element state (Adam's exp_avg,
exp_avg_sq, ...) as a tensor of the unsharded parameter's shape, of which a rank holds its TP
shard (a DTensor) or, under ZeRO-1, the rectangles covering its flat segment of the TP shard
(a ChunkedTensor); other state (Adam's step) as a plain tensor or object, equal on every rank
that holds the parameter. Both forms describe the same global tensor, so a checkpoint written
with or without ZeRO, under any tp and dp, loads into any other.

Keys: "optim.{name}.{state key}" and "hparams.{name}" (the param group's options).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from torchpp.checkpoint.chunks import ChunkedTensor
from torchpp.checkpoint.layout import (WholeLayout, as_dtensor, expert_shape_and_offset, global_shape_and_offset,
                                       saved_whole, tp_partition, tp_saved_whole)
from torchpp.checkpoint.zero_whole import gather_whole_zero_state, segment_of_whole
from torchpp.parallel.groups import ParallelState
from torchpp.parallel.optimizer import DistributedOptimizer
from torchpp.parallel.zero import ZeroRedundancyOptimizer, _Segment

STATE_PREFIX = "optim."
HPARAMS_PREFIX = "hparams."


@dataclass
class _Leaf:
    """One tensor the wrapped optimizer updates, and the model parameter it belongs to."""

    tensor: torch.Tensor  # the optimizer's key: the parameter, or a ZeRO shard view of it
    param: nn.Parameter
    name: str
    group: Dict[str, Any]
    segment: Optional[_Segment]


def _unwrap(optimizer):
    """The ZeroRedundancyOptimizer or torch.optim optimizer inside a DistributedOptimizer."""
    return optimizer.optimizer if isinstance(optimizer, DistributedOptimizer) else optimizer


def _inner(optimizer) -> torch.optim.Optimizer:
    return optimizer.optimizer if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer


def _leaves(optimizer, params: Mapping[str, nn.Parameter]) -> List[_Leaf]:
    name_of = {id(p): name for name, p in params.items()}
    segment_of = {}
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        segment_of = {id(s.shard_view): s for s in optimizer.segments}
    leaves = []
    for group in _inner(optimizer).param_groups:
        for tensor in group["params"]:
            segment = segment_of.get(id(tensor))
            if isinstance(optimizer, ZeroRedundancyOptimizer) and segment is None:
                continue  # the placeholder of a rank whose shard is all padding
            param = segment.param if segment is not None else tensor
            if id(param) not in name_of:
                raise KeyError(f"torchpp.checkpoint: the optimizer holds a parameter of shape {tuple(param.shape)} that the model does not")
            leaves.append(_Leaf(tensor, param, name_of[id(param)], group, segment))
    return leaves


def _per_element(leaf: _Leaf, local: torch.Tensor, state: ParallelState, loading: bool = False,
                 gathered: Optional[torch.Tensor] = None) -> Tuple[Any, bool, Optional[torch.Tensor]]:
    """`local` (state shaped like the leaf) as a DTensor, or as a ChunkedTensor under ZeRO; for
    a parameter saved whole (see saved_whole), the full tensor (a buffer when `loading`; under
    ZeRO, `gathered` beforehand by gather_whole_zero_state).
    Returns (entry, whether it is chunked, the full tensor when saved whole)."""
    experts = getattr(leaf.param, "expert_parallel", None) is not None
    if experts and leaf.segment is not None and not tp_saved_whole(leaf.param, state):
        # ZeRO over the expert-data-parallel ranks: this rank's flat segment of its experts'
        # block, which sits at a known offset of the whole tensor.
        shape, shift = expert_shape_and_offset(leaf.param, state)
        return ChunkedTensor.from_flat_range(local, leaf.param.shape, leaf.segment.param_lo, shape, shift), True, None
    if saved_whole(leaf.param, state):
        layout = WholeLayout(leaf.param, state)
        if loading:
            full = torch.empty(layout.full_shape(leaf.param.shape), dtype=local.dtype, device=local.device)
        elif leaf.segment is not None:
            full = gathered
        else:
            full = layout.gather(local)
        return as_dtensor(full, None, state), False, full
    dim = tp_partition(leaf.param, state)
    if leaf.segment is None:
        return as_dtensor(local, dim, state), False, None
    shape, shift = global_shape_and_offset(leaf.param, dim, state)
    return ChunkedTensor.from_flat_range(local, leaf.param.shape, leaf.segment.param_lo, shape, shift), True, None


def optimizer_entries(optimizer, params: Mapping[str, nn.Parameter], state: ParallelState) -> Tuple[Dict[str, Any], Dict[str, ChunkedTensor]]:
    """This rank's optimizer state as (DCP state dict entries, chunked entries) for saving.

    Args:
        optimizer: a torch.optim optimizer, ZeroRedundancyOptimizer or DistributedOptimizer.
        params: {global name: parameter} of the model part this rank holds.
        state: the parallel layout.
    """
    optimizer = _unwrap(optimizer)
    plain: Dict[str, Any] = {}
    chunked: Dict[str, ChunkedTensor] = {}
    inner = _inner(optimizer)
    whole_zero = gather_whole_zero_state(optimizer, state)
    for leaf in _leaves(optimizer, params):
        plain[HPARAMS_PREFIX + leaf.name] = {k: v for k, v in leaf.group.items() if k != "params"}
        for key, value in inner.state.get(leaf.tensor, {}).items():
            fqn = f"{STATE_PREFIX}{leaf.name}.{key}"
            if torch.is_tensor(value) and value.dim() > 0 and value.shape == leaf.tensor.shape:
                entry, is_chunked, _ = _per_element(leaf, value, state,
                                                    gathered=whole_zero.get((id(leaf.param), key)))
                (chunked if is_chunked else plain)[fqn] = entry
            else:
                plain[fqn] = value
    return plain, chunked


@dataclass
class OptimizerTargets:
    """Where a load writes the optimizer state, and how to install it afterwards."""

    plain: Dict[str, Any]
    chunked: Dict[str, ChunkedTensor]
    # (leaf, state key, local tensor or None for objects read into `plain`)
    slots: List[Tuple[_Leaf, str, Optional[torch.Tensor]]]
    leaves: List[_Leaf]
    # (local tensor, full buffer, layout, ZeRO segment or None) of state saved whole: the local
    # tensor takes its TP shard, or that shard's segment
    whole: List[Tuple[torch.Tensor, torch.Tensor, Any, Optional[_Segment]]] = field(default_factory=list)

    def install(self, optimizer) -> None:
        """Puts the loaded tensors and group options into the optimizer (after the DCP load)."""
        inner = _inner(_unwrap(optimizer))
        for local, full, layout, segment in self.whole:
            local.copy_(layout.shard(full) if segment is None else segment_of_whole(full, layout, segment))
        for leaf, key, local in self.slots:
            value = local if local is not None else self.plain[f"{STATE_PREFIX}{leaf.name}.{key}"]
            inner.state[leaf.tensor][key] = value
        done = set()
        for leaf in self.leaves:  # each group takes the options saved with its first parameter
            hparams = self.plain.get(HPARAMS_PREFIX + leaf.name)
            if hparams is not None and id(leaf.group) not in done:
                leaf.group.update(hparams)
                done.add(id(leaf.group))


def optimizer_targets(optimizer, params: Mapping[str, nn.Parameter], state: ParallelState, metadata) -> OptimizerTargets:
    """Empty state for every parameter the checkpoint (its DCP `metadata`) has state for.

    Args:
        optimizer: a torch.optim optimizer, ZeroRedundancyOptimizer or DistributedOptimizer.
        params: {global name: parameter} of the model part this rank holds.
        state: the parallel layout.
        metadata: the checkpoint's torch.distributed.checkpoint Metadata.
    """
    optimizer = _unwrap(optimizer)
    saved = metadata.state_dict_metadata
    keys_of: Dict[str, List[str]] = {}
    for fqn in saved:
        if fqn.startswith(STATE_PREFIX):
            name, _, key = fqn[len(STATE_PREFIX):].rpartition(".")
            keys_of.setdefault(name, []).append(key)
    targets = OptimizerTargets({}, {}, [], _leaves(optimizer, params))
    for leaf in targets.leaves:
        if HPARAMS_PREFIX + leaf.name in saved:
            targets.plain[HPARAMS_PREFIX + leaf.name] = None
        for key in keys_of.get(leaf.name, []):
            fqn = f"{STATE_PREFIX}{leaf.name}.{key}"
            md = saved[fqn]
            local = None
            if isinstance(md, BytesStorageMetadata):
                targets.plain[fqn] = None
            elif _is_per_element(md, leaf, state):
                # Like Optimizer.load_state_dict: floating state takes the parameter's dtype.
                dtype = leaf.param.dtype if leaf.param.is_floating_point() else md.properties.dtype
                local = torch.empty_like(leaf.tensor, dtype=dtype, memory_format=torch.contiguous_format)
                entry, is_chunked, full = _per_element(leaf, local, state, loading=True)
                if full is not None:
                    targets.whole.append((local, full, WholeLayout(leaf.param, state), leaf.segment))
                (targets.chunked if is_chunked else targets.plain)[fqn] = entry
            else:
                # torch.optim keeps "step" on the CPU unless capturable/fused (see Optimizer.load_state_dict).
                on_param = key != "step" or leaf.group.get("capturable") or leaf.group.get("fused")
                device = leaf.param.device if on_param else torch.device("cpu")
                local = targets.plain[fqn] = torch.empty(md.size, dtype=md.properties.dtype, device=device)
            targets.slots.append((leaf, key, local))
    return targets


def _is_per_element(md: TensorStorageMetadata, leaf: _Leaf, state: ParallelState) -> bool:
    if saved_whole(leaf.param, state):
        shape = WholeLayout(leaf.param, state).full_shape(leaf.param.shape)
    else:
        shape, _ = global_shape_and_offset(leaf.param, tp_partition(leaf.param, state), state)
    return len(md.size) > 0 and md.size == shape
