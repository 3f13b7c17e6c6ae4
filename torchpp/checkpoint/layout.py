"""Where a parameter's local tensor sits in the unsharded model: global names and TP shards.

Checkpoint keys are the parameter names of the one-process model, and every tensor is saved
as its part of the unsharded tensor, so the same files load under any (tp, pp, dp).
"""
from __future__ import annotations

import functools
from typing import Dict, Mapping, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from torchpp.parallel.groups import ParallelState
from torchpp.tensor_parallel.layouts import Replicated, Split

ModelLike = Union[nn.Module, Mapping[str, nn.Parameter]]


def stage_parameters(stage: nn.Module, *, full_model: Optional[nn.Module] = None, first_layer: int = 0) -> Dict[str, nn.Parameter]:
    """A pipeline stage's parameters under their names in the unsharded model.

    Args:
        stage: the stage's module (e.g. one part returned by torchpp.pipeline.split_model).
        full_model: the model the stage was cut from (its modules are shared with the stage);
            names are looked up by identity. Works for any split, nested ones included.
        first_layer: without full_model, the stage is taken to be layers
            [first_layer, first_layer + len(stage)) of a top-level nn.Sequential (such as
            torchpp.models.gpt.GPT): a local name "i.rest" becomes "{first_layer + i}.rest".

    Returns:
        {global name: parameter}, in the stage's order.
    """
    if full_model is not None:
        name_of = {id(p): name for name, p in full_model.named_parameters()}
        missing = [name for name, p in stage.named_parameters() if id(p) not in name_of]
        if missing:
            raise KeyError(f"torchpp.checkpoint: stage parameters {missing} are not parameters of full_model")
        return {name_of[id(p)]: p for _, p in stage.named_parameters()}
    named = {}
    for name, param in stage.named_parameters():
        index, _, rest = name.partition(".")
        if not index.isdigit():
            raise ValueError(
                f"torchpp.checkpoint: stage parameter {name!r} is not under a numbered layer; pass full_model="
            )
        named[f"{first_layer + int(index)}.{rest}"] = param
    return named


def named_parameters(model: ModelLike) -> Dict[str, nn.Parameter]:
    """{global name: parameter} of a whole model, or the mapping itself (see stage_parameters)."""
    if isinstance(model, nn.Module):
        return dict(model.named_parameters())
    return dict(model)


def tp_partition(param: torch.Tensor, state: ParallelState) -> Optional[int]:
    """The dim along which `param` is split over the TP group, or None when replicated."""
    if not getattr(param, "tensor_model_parallel", False):
        return None
    if param.tp_size != state.tp:
        raise ValueError(
            f"torchpp.checkpoint: a parameter of shape {tuple(param.shape)} is split over {param.tp_size} ranks, "
            f"but the TP group has {state.tp}"
        )
    return param.partition_dim


def saved_whole(param: torch.Tensor, state: ParallelState) -> bool:
    """True when ``param``'s TP shard is not one contiguous block of the full tensor (fused
    blocks split block by block, heads copied over ranks, a vocabulary padded to a multiple of
    tp), or when it holds this rank's experts (expert parallelism): it is saved as the full
    tensor, so the files stay independent of the layout."""
    if getattr(param, "expert_parallel", None) is not None:
        return True
    return tp_saved_whole(param, state)


def tp_saved_whole(param: torch.Tensor, state: ParallelState) -> bool:
    """True when ``param``'s TP shard is not one contiguous block of the full tensor."""
    layout = getattr(param, "tp_layout", None)
    if layout is None or isinstance(layout, Replicated) or state.tp == 1:
        return False
    return not (isinstance(layout, Split) and layout.full_size % state.tp == 0)


def expert_shape_and_offset(param: torch.Tensor, state: ParallelState) -> Tuple[torch.Size, Tuple[int, ...]]:
    """For an expert parameter whose TP shard is one block (``tp_saved_whole`` False): the shape
    of the whole tensor (every expert) and where this rank's block starts in it (its experts
    along dim 0, its TP shard along the partition dim)."""
    dim = tp_partition(param, state)
    if dim == 0:
        raise NotImplementedError("torchpp.checkpoint: an expert parameter split over TP along its experts' dim 0")
    shape, offset = global_shape_and_offset(param, dim, state)
    _, ep_rank, ep_size = param.expert_parallel
    return (torch.Size([shape[0] * ep_size, *shape[1:]]),
            (offset[0] + ep_rank * param.shape[0], *offset[1:]))


class WholeLayout:
    """How a tensor saved whole maps to this rank's part: its TP layout (``tp_layout``), and for
    expert parameters, this rank's block of experts (dim 0) over the ep group first."""

    def __init__(self, param: torch.Tensor, state: ParallelState):
        self.tp = getattr(param, "tp_layout", None) if state.tp > 1 else None
        if self.tp is not None and self.tp.dim is None:
            self.tp = None  # replicated over TP
        self.experts = getattr(param, "expert_parallel", None)  # (ep group, ep rank, ep size)
        self.state = state

    def full_shape(self, local_shape) -> torch.Size:
        shape = list(self.tp.full_shape(local_shape, self.state.tp) if self.tp is not None else local_shape)
        if self.experts is not None:
            shape[0] *= self.experts[2]
        return torch.Size(shape)

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """The full tensor (collective over TP, then the ep group)."""
        full = gather_whole(local, self.tp, self.state) if self.tp is not None else local.detach().contiguous()
        if self.experts is not None:
            group, _, size = self.experts
            shards = [torch.empty_like(full) for _ in range(size)]
            dist.all_gather(shards, full, group=group)
            full = torch.cat(shards)
        return full

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of ``full``."""
        if self.experts is not None:
            _, rank, size = self.experts
            local = full.size(0) // size
            full = full[rank * local:(rank + 1) * local]
        return self.tp.shard(full, self.state.tp_rank, self.state.tp) if self.tp is not None else full


def gather_whole(local: torch.Tensor, layout, state: ParallelState) -> torch.Tensor:
    """The full tensor of which ``local`` is this rank's shard under ``layout`` (a parameter's
    ``tp_layout``; its optimizer state shares it). Collective over TP."""
    shards = [torch.empty_like(local) for _ in range(state.tp)]
    dist.all_gather(shards, local.detach().contiguous(), group=state.tp_group)
    return layout(shards)


def global_shape_and_offset(local: torch.Tensor, dim: Optional[int], state: ParallelState) -> Tuple[torch.Size, Tuple[int, ...]]:
    """Shape of the unsharded tensor and where this rank's TP shard starts in it."""
    shape, offset = list(local.shape), [0] * local.dim()
    if dim is not None:
        offset[dim] = state.tp_rank * shape[dim]
        shape[dim] *= state.tp
    return torch.Size(shape), tuple(offset)


def as_dtensor(local: torch.Tensor, dim: Optional[int], state: ParallelState) -> DTensor:
    """`local` (sharing its storage) as a DTensor over this stage's ("dp", "tp") mesh:
    Shard(dim) over tp (Replicate when dim is None), Replicate over dp."""
    mesh = _dp_tp_mesh(state.mesh)
    placements = [Replicate(), Replicate() if dim is None else Shard(dim)]
    shape, _ = global_shape_and_offset(local, dim, state)
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)



@functools.lru_cache(maxsize=8)
def _dp_tp_mesh(mesh):
    return mesh["dp", "tp"]  # this pipeline stage's slice of the ("pp", "dp", "tp") mesh
