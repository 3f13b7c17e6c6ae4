"""Megatron model chunks trained by torchpp's DistributedOptimizer instead of Megatron's DDP.

Megatron's ``finalize_model_grads`` sums what its schedule leaves partial (sequence-parallel
norm gradients over TP, the tied embedding's two copies over the embedding group) but expects
chunks wrapped by its DDP. ``finalize_model_grads`` here takes chunks with or without that
wrapper: unwrapped ones keep their gradients in ``.grad``, and data parallelism is left to
torchpp's optimizer. ``parallel_state`` gives that optimizer Megatron's process groups.
"""
from __future__ import annotations

from typing import List, Optional

import torch
from torch import nn

from torchpp.parallel.groups import ParallelState
from torchpp.parallel.object_collectives import all_gather_objects


class _GradsInPlace:
    """The DDP interface Megatron's finalize_model_grads reads, over a chunk without DDP."""

    def __init__(self, module: nn.Module):
        from megatron.core.distributed import DistributedDataParallelConfig

        self.module = module
        self.ddp_config = DistributedDataParallelConfig()

    def finish_grad_sync(self, force_all_reduce: Optional[bool] = False) -> None:
        """Data parallelism is torchpp's optimizer's (its step() reduces)."""

    def scale_gradients(self, scaling_factor: float) -> None:
        for param in self.module.parameters():
            if param.grad is not None:
                param.grad.mul_(scaling_factor)


def finalize_model_grads(model: List[nn.Module], num_tokens: Optional[torch.Tensor] = None, pg_collection=None,
                         force_all_reduce: Optional[bool] = False) -> None:
    """Megatron's ``finalize_model_grads`` (set it as ``config.finalize_model_grads_func``),
    for chunks wrapped by Megatron's DDP or not (then their ``.grad``; DP is torchpp's).

    Args:
        model: this rank's model chunks.
        num_tokens: the step's token count, with ``config.calculate_per_token_loss``.
        pg_collection: Megatron's ProcessGroupCollection (None: its parallel_state).
        force_all_reduce: as Megatron's.
    """
    from megatron.core.distributed import finalize_model_grads as megatron_finalize

    chunks = [chunk if hasattr(chunk, "finish_grad_sync") else _GradsInPlace(chunk) for chunk in model]
    megatron_finalize(chunks, num_tokens, pg_collection=pg_collection, force_all_reduce=force_all_reduce)


def summed_after_backward(model: List[nn.Module]) -> List[nn.Parameter]:
    """Parameters whose gradients finalize_model_grads sums over ranks after backward: the
    tied embedding's copies and, under TP, q/k layernorms (sequence-parallel norms are held by
    their ``sequence_parallel`` flag). Pass them as ``DistributedOptimizer(hold=...)`` so data
    parallelism waits for the sums. Also flags the last stage's embedding copy
    ``shared_duplicate``, so the gradient norm counts the tied embedding once (Megatron's
    ``shared`` copy).

    Args:
        model: this rank's model chunks.
    """
    held = []
    for chunk in model:
        for name, param in chunk.named_parameters():
            if getattr(param, "shared", False):
                param.shared_duplicate = True
            if (getattr(param, "shared_embedding", False) or getattr(param, "shared", False)
                    or "q_layernorm" in name or "k_layernorm" in name):
                held.append(param)
    return held


def parallel_state() -> ParallelState:
    """torchpp's ParallelState over Megatron's initialised tensor, pipeline and data-parallel
    groups (for ``torchpp.parallel.DistributedOptimizer`` and clipping). Call on every rank."""
    from megatron.core import parallel_state as mps
    from torch.distributed.device_mesh import DeviceMesh

    from torchpp.parallel.groups import MESH_DIMS

    tp_group = mps.get_tensor_model_parallel_group()
    pp_group = mps.get_pipeline_model_parallel_group()
    dp_group = mps.get_data_parallel_group()
    coords = (pp_group.rank(), dp_group.rank(), tp_group.rank())
    sizes = (pp_group.size(), dp_group.size(), tp_group.size())
    everyone = all_gather_objects(coords)
    grid = torch.empty(sizes, dtype=torch.int64)
    for rank, where in enumerate(everyone):
        grid[where] = rank
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    mesh = DeviceMesh.from_group([pp_group, dp_group, tp_group], device.type, mesh=grid, mesh_dim_names=MESH_DIMS)
    return ParallelState(tp=sizes[2], pp=sizes[0], dp=sizes[1], order="tp-dp-pp", mesh=mesh, tp_group=tp_group,
                         pp_group=pp_group, dp_group=dp_group,
                         model_parallel_group=mps.get_model_parallel_group(), tp_rank=coords[2], pp_rank=coords[0],
                         dp_rank=coords[1], device=device)
