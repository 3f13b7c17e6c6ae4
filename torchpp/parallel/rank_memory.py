"""What one rank holds for training: bytes of parameters, gradients and optimizer state.

Counted from the storages that are allocated now (a ZeRO-3 parameter or a ZeRO-2 gradient
whose bucket was released has a storage of 0 bytes), each storage once, so views of one flat
buffer are not counted twice.
"""
from __future__ import annotations

from typing import Dict, Iterable, Optional

import torch


def _storage_bytes(tensors: Iterable[Optional[torch.Tensor]], seen: set) -> int:
    total = 0
    for tensor in tensors:
        if tensor is None:
            continue
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if storage.nbytes() == 0 or key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def rank_memory_bytes(params, zero_optimizer, torch_optimizer: torch.optim.Optimizer) -> Dict[str, int]:
    """{"param", "grad", "optimizer"} bytes held by this rank.

    Args:
        params: the model parameters given to the optimizer.
        zero_optimizer: the ZeroRedundancyOptimizer (ZeRO-1..3), else None.
        torch_optimizer: the torch.optim optimizer whose state is counted.
    """
    seen: set = set()
    param_tensors = list(params)
    grad_tensors = [p.grad for p in params]
    if zero_optimizer is not None:
        param_tensors += [flat.param_shard for flat in zero_optimizer.flat_groups]
        grad_tensors += [flat.grad_shard for flat in zero_optimizer.flat_groups]
    out = {"param": _storage_bytes(param_tensors, seen), "grad": _storage_bytes(grad_tensors, seen)}
    state = [v for s in torch_optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    out["optimizer"] = _storage_bytes(state, seen)
    return out
