"""Small helpers shared by the tensor-parallel layers."""
from __future__ import annotations

import torch


def divide(numerator: int, denominator: int, what: str) -> int:
    """numerator / denominator, raising a ValueError naming both when it does not divide."""
    if denominator <= 0 or numerator % denominator != 0:
        raise ValueError(f"torchpp: {what}={numerator} is not divisible by the tensor-parallel size {denominator}")
    return numerator // denominator


def through_slot(local: torch.Tensor, slot: int, slots: int, collective) -> torch.Tensor:
    """``collective`` (a sum over TP ranks) applied to ``local`` in slot ``slot`` of a zero-padded
    row of ``slots`` (last dim), and that slot taken back: only the ranks sharing a slot (copies of
    one head or group) add into each other's."""
    pieces = [local if s == slot else torch.zeros_like(local) for s in range(slots)]
    return collective(torch.cat(pieces, dim=-1)).narrow(-1, slot * local.size(-1), local.size(-1))


def check_same_device(input: torch.Tensor, parameter: torch.Tensor, layer: str) -> None:
    """Raises naming both devices when a layer's input is not where its parameters are."""
    if input.device != parameter.device:
        raise RuntimeError(
            f"torchpp.{layer}: input is on device '{input.device}' but the layer's parameters are on "
            f"'{parameter.device}'; move the input (or the layer) to the same device"
        )


def mark_tensor_parallel(param: torch.nn.Parameter, partition_dim: int, group_size: int) -> None:
    """Records how a parameter is sharded (checkpointing and gradient-norm code read it)."""
    param.tensor_model_parallel = True
    param.partition_dim = partition_dim
    param.partition_stride = 1
    param.tp_size = group_size


def mark_sequence_parallel(module: torch.nn.Module) -> torch.nn.Module:
    """Flags every parameter of `module` as replicated across TP ranks that see different
    parts of the data: sequence slices (LayerNorm/RMSNorm in a sequence-parallel region), or
    their own heads (per-head norms such as Qwen3's q/k norms). Their gradients are partial
    sums until `allreduce_sequence_parallel_grads` adds them up."""
    for param in module.parameters():
        param.sequence_parallel = True
    return module


def mark_tp_replicas(param: torch.nn.Parameter, replicas: int, tp_rank: int) -> None:
    """Flags a TP-sharded parameter whose shard is the same on each group of ``replicas``
    consecutive TP ranks: key/value heads when tp exceeds their number, each rank holding a copy
    of the head its query heads share. A copy's gradient is its rank's share until
    ``allreduce_tp_replica_grads`` sums the group's; the gradient norm counts the group's first
    copy only, and data parallelism waits for the sum."""
    param.tp_replicas = replicas
    param.grad_summed_after_backward = True
    if tp_rank % replicas:
        param.shared_duplicate = True


def tp_replica_params(module: torch.nn.Module):
    """The parameters of ``module`` flagged by mark_tp_replicas."""
    return [p for p in module.parameters() if getattr(p, "tp_replicas", 1) > 1]


def allreduce_tp_replica_grads(module: torch.nn.Module, group=None) -> None:
    """Sums the gradients of parameters flagged by ``mark_tp_replicas`` over their replica
    groups (every copy gets the same sum, added in the same order). Call once per optimizer
    step, after the last backward, on every rank of the TP group."""
    import torch.distributed as dist

    from torchpp.ops import group_of
    from torchpp.parallel.collectives_compat import all_gather_single

    params = tp_replica_params(module)
    if not params:
        return
    replicas = params[0].tp_replicas
    if any(p.tp_replicas != replicas for p in params):
        raise ValueError(f"torchpp: parameters copied onto different numbers of TP ranks "
                         f"{sorted({p.tp_replicas for p in params})} in one module")
    group = group_of(group)
    first = dist.get_rank(group) // replicas * replicas

    def sum_copies(flat: torch.Tensor) -> torch.Tensor:
        gathered = flat.new_empty(group.size() * flat.numel())
        all_gather_single(gathered, flat, group=group)
        return gathered.view(group.size(), -1)[first : first + replicas].sum(0)

    combine_flat_grads(params, sum_copies)


def combine_flat_grads(params, combine) -> None:
    """Replaces the gradients of ``params`` (zeros where one is None) by ``combine`` of them
    flattened into one tensor, e.g. a sum with other ranks' in one message."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    combined = combine(torch._utils._flatten_dense_tensors(grads))
    for param, grad in zip(params, torch._utils._unflatten_dense_tensors(combined, grads)):
        if param.grad is None:
            param.grad = grad.clone()
        else:  # in place: .grad may be a view of a data-parallel bucket
            param.grad.copy_(grad)


def share_summed_grads(params, group_size: int) -> None:
    """Prepares gradients that an earlier step summed over a group of ``group_size`` ranks for
    another backward that accumulates onto them (gradient accumulation over several steps).

    After that sum every rank of the group holds the same total S; dividing each copy by the
    group size first makes the next sum give S plus every rank's new share, instead of
    ``group_size`` times S. Call before the backward, on every rank of the group.
    """
    if group_size <= 1:
        return
    for param in params:
        if param.grad is not None:
            param.grad.div_(group_size)


def sequence_parallel_params(module: torch.nn.Module):
    """The parameters of ``module`` flagged ``sequence_parallel`` (see mark_sequence_parallel)."""
    return [p for p in module.parameters() if getattr(p, "sequence_parallel", False)]


def allreduce_sequence_parallel_grads(module: torch.nn.Module, group=None) -> None:
    """Sums, over the TP group, the gradients of parameters flagged sequence_parallel.

    Call once per optimizer step, after the last backward (Megatron's finalize_model_grads).
    """
    import torch.distributed as dist

    from torchpp.ops import group_of

    grads = [p.grad for p in sequence_parallel_params(module) if p.grad is not None]
    if not grads:
        return
    flat = torch._utils._flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=group_of(group))
    for grad, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
        grad.copy_(synced)
