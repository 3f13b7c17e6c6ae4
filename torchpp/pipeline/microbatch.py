"""Splitting a step's batch into microbatches, and the loss weights that make the summed
microbatch gradients equal the full-batch gradient."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch


def split_microbatches(batch: Optional[torch.Tensor], num_microbatches: int) -> Optional[List[torch.Tensor]]:
    """Splits along dim 0 into ``num_microbatches`` parts whose sizes differ by at most one.

    Args:
        batch: the step's tensor (None passes through).
        num_microbatches: number of parts.
    """
    if batch is None:
        return None
    if not isinstance(batch, torch.Tensor):
        raise TypeError(f"torchpp pipeline: step inputs must be tensors, got {type(batch).__name__}")
    if batch.dim() == 0 or batch.size(0) < num_microbatches:
        raise ValueError(
            f"torchpp pipeline: a batch of shape {tuple(batch.shape)} cannot be split into "
            f"{num_microbatches} microbatches along dim 0"
        )
    return list(torch.tensor_split(batch, num_microbatches, dim=0))


def split_arguments(args: Tuple[Any, ...], kwargs: Dict[str, Any],
                    num_microbatches: int) -> List[Tuple[Tuple[Any, ...], Dict[str, Any]]]:
    """Per microbatch, the first stage's further positional and keyword arguments: tensors split
    along dim 0 like the batch, anything else passed to every microbatch as is (the default
    chunking of torch.distributed.pipelining)."""
    def parts(value):
        return split_microbatches(value, num_microbatches) if isinstance(value, torch.Tensor) \
            else [value] * num_microbatches

    split_args = [parts(a) for a in args]
    split_kwargs = {k: parts(v) for k, v in kwargs.items()}
    return [(tuple(a[i] for a in split_args), {k: v[i] for k, v in split_kwargs.items()})
            for i in range(num_microbatches)]


def loss_weights(microbatches: List[torch.Tensor]) -> List[float]:
    """Each microbatch's share of the batch: a mean loss times its share sums to the batch mean."""
    total = sum(mb.size(0) for mb in microbatches)
    return [mb.size(0) / total for mb in microbatches]
