"""Gradient clipping by the global norm over dp x pp x tp, each gradient element counted once.

Parameters sharded by TP (tensor_model_parallel) contribute their shard on every TP rank;
parameters replicated over TP (norms, row-parallel biases) hold the same gradient on every
TP rank, so only TP rank 0 counts them. Pipeline stages hold disjoint parameters, except
copies flagged ``shared_duplicate`` (a tied output embedding on the last stage; under
DualPipe, the twin copy of another rank's stage), which the rank holding the original counts. Without
ZeRO the data-parallel replicas hold identical (already averaged) gradients, so the sum runs
over the model-parallel group (pp x tp); with ZeRO-1 each DP rank holds a disjoint shard, so
it runs over the whole world. Context-parallel ranks hold the same (summed) gradients: the
model-parallel group holds one of them, and ZeRO-1 shards over dp x cp. Expert-parallel
ranks (inside dp x cp) hold different experts: the experts' squares are summed over the ep
group before the model-parallel sum.
"""
from __future__ import annotations

from typing import Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist


def _counted_here(param: torch.Tensor, tp_rank: int) -> bool:
    if getattr(param, "shared_duplicate", False):  # e.g. a tied output embedding on the last stage
        return False
    return bool(getattr(param, "tensor_model_parallel", False)) or tp_rank == 0


def _counted_squares(grad: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """The sum of ``grad``'s squares, less the rows copied from another TP rank that counts them
    (``tp_uncounted``: a fused q/k/v projection's copied key/value heads)."""
    squared = grad.detach().float().pow(2)
    uncounted = getattr(param, "tp_uncounted", None)
    if uncounted is None:
        return squared.sum()
    dim, start, stop = uncounted
    counted = torch.ones(param.shape, dtype=torch.bool, device=grad.device)
    counted.narrow(dim, start, stop - start).fill_(False)
    if grad.shape != param.shape:  # a ZeRO segment: its part of the flattened parameter
        lo = getattr(param, "zero_param_lo", 0)
        counted = counted.flatten()[lo:lo + grad.numel()].view(grad.shape)
    return squared[counted].sum()


def local_squared_norm(grads_and_params: Iterable[Tuple[torch.Tensor, torch.Tensor]], tp_rank: int) -> torch.Tensor:
    """This rank's share of the global sum of squares (float64), each element counted once."""
    total = None
    for grad, param in grads_and_params:
        if grad is None or not _counted_here(param, tp_rank):
            continue
        squared = _counted_squares(grad, param)
        total = squared if total is None else total + squared
    if total is None:
        total = torch.zeros((), dtype=torch.float32)
    return total.to(torch.float64)


def expert_summed_squared_norm(grads_and_params, tp_rank: int, ep_group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """This rank's share of the sum of squares with the experts' squares summed over ``ep_group``
    (whose ranks hold different experts), so a sum over the model-parallel group counts each once."""
    pairs = list(grads_and_params)
    if ep_group is None or ep_group.size() == 1:
        return local_squared_norm(pairs, tp_rank)
    experts = local_squared_norm([(g, p) for g, p in pairs if getattr(p, "expert_parallel", None)], tp_rank)
    dist.all_reduce(experts, group=ep_group)
    return local_squared_norm([(g, p) for g, p in pairs if not getattr(p, "expert_parallel", None)], tp_rank) + experts


def global_grad_norm(
    grads_and_params: Iterable[Tuple[torch.Tensor, torch.Tensor]],
    tp_rank: int,
    group: Optional[dist.ProcessGroup],
    ep_group: Optional[dist.ProcessGroup] = None,
) -> torch.Tensor:
    """sqrt(sum of squares) of the gradients over `group`, each element counted once.

    Args:
        grads_and_params: (gradient, owning model parameter) pairs held by this rank.
        tp_rank: this rank's TP rank (replicated parameters count on TP rank 0 only).
        group: the group to sum over (model-parallel group, or the world under ZeRO-1).
        ep_group: the expert-parallel group (without ZeRO), over which expert gradients differ.
    """
    total = expert_summed_squared_norm(grads_and_params, tp_rank, ep_group)
    if group is not None and group.size() > 1:
        dist.all_reduce(total, group=group)
    return total.sqrt()


def clip_coefficient(total_norm: torch.Tensor, max_norm: float, eps: float = 1e-6) -> torch.Tensor:
    """min(1, max_norm / (total_norm + eps)), as torch's clip_grad_norm_ computes it."""
    return (max_norm / (total_norm + eps)).clamp(max=1.0)


def clip_grads_(grads: List[torch.Tensor], total_norm: torch.Tensor, max_norm: float) -> None:
    """Scales `grads` in place by clip_coefficient(total_norm, max_norm)."""
    scale = clip_coefficient(total_norm, max_norm)
    for grad in grads:
        if grad is not None:
            grad.mul_(scale.to(grad.dtype))


def norm_inputs(parameters: Iterable[torch.nn.Parameter], state, zero_optimizer=None):
    """The (gradient, parameter) pairs this rank counts in the global norm, and the group to sum over."""
    if zero_optimizer is not None:
        pairs = [(s.shard_view.grad, s.param) for s in zero_optimizer.segments]
        return pairs, dist.group.WORLD if dist.get_world_size() > 1 else None
    return [(p.grad, p) for p in parameters], state.model_parallel_group


def clip_grad_norm_(
    parameters: Iterable[torch.nn.Parameter],
    max_norm: float,
    *,
    state=None,
    zero_optimizer=None,
) -> torch.Tensor:
    """Clips gradients by the global norm across dp x pp x tp; returns the norm (before clipping).

    Args:
        parameters: this rank's model parameters (ignored with zero_optimizer, whose shards are used).
        max_norm: the largest allowed global norm.
        state: the ParallelState (default: torchpp.parallel.get_parallel_state()).
        zero_optimizer: a ZeroRedundancyOptimizer whose gradients were reduce-scattered
            (call its reduce_scatter_grads() first, then step(grads_reduced=True)).
    """
    from torchpp.parallel.groups import get_parallel_state

    state = state or get_parallel_state()
    pairs, group = norm_inputs(parameters, state, zero_optimizer)
    total = global_grad_norm(pairs, state.tp_rank, group, None if zero_optimizer is not None else state.ep_group)
    clip_grads_([g for g, _ in pairs], total, max_norm)
    return total
