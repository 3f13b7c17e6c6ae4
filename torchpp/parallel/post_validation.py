"""Optimizer post-validation (zero-bubble paper, section 4): update now, check the global norm later.

Clipping by the global gradient norm needs an all-reduce over every pipeline stage before
any rank may update, so the ranks that finish their backward first wait for the last one:
under ZB-H2 that wait is the bubble the schedule removed. Post-validation updates at once as
if no clipping were needed, while the norm's all-reduce runs in the background, and checks it
at the next step. Clipping rarely triggers in stable training; when it does, the update is
rolled back from a copy and redone with the clipped gradients, and the batch whose gradients
came from the speculative parameters runs again. Every rank reaches the same verdict, so they
roll back together, and the trajectory is exactly the synchronous one.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_unflatten


class BackupBuffers:
    """Copies of tensors into buffers allocated once and reused every step (a fresh allocation
    per step would page-fault its way through as much memory as the model's state)."""

    def __init__(self):
        self._buffers: Dict[str, List[Optional[torch.Tensor]]] = {}

    def copy(self, name: str, tensors: List[Optional[torch.Tensor]]) -> List[Optional[torch.Tensor]]:
        old = self._buffers.get(name, [])
        kept = []
        for k, tensor in enumerate(tensors):
            if tensor is None:
                kept.append(None)
                continue
            buffer = old[k] if k < len(old) else None
            if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
                buffer = torch.empty_like(tensor, memory_format=torch.contiguous_format)
            kept.append(buffer.copy_(tensor.detach()))
        self._buffers[name] = kept
        return kept


class SpeculativeStep:
    """What undoes one speculative update: copies of the parameters, gradients and optimizer
    state it started from, and the in-flight all-reduce of the gradients' squared norm."""

    def __init__(self, optimizer: torch.optim.Optimizer, squared_norm: torch.Tensor,
                 group: Optional[dist.ProcessGroup], buffers: BackupBuffers):
        self.tensors: List[torch.Tensor] = [p for g in optimizer.param_groups for p in g["params"]]
        self.params = buffers.copy("params", self.tensors)
        self.grads = buffers.copy("grads", [p.grad for p in self.tensors])
        leaves, self._state_spec = tree_flatten(optimizer.state_dict())
        tensors = buffers.copy("state", [x if isinstance(x, torch.Tensor) else None for x in leaves])
        self._state_leaves = [t if isinstance(x, torch.Tensor) else x for x, t in zip(leaves, tensors)]
        self.squared_norm = squared_norm
        self.work = dist.all_reduce(squared_norm, group=group, async_op=True) if group is not None else None

    def global_norm(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.squared_norm.sqrt()

    @torch.no_grad()
    def rewind(self, optimizer: torch.optim.Optimizer) -> List[Optional[torch.Tensor]]:
        """Puts parameters, gradients and optimizer state back as they were before the update
        (param-group options, which an LR scheduler may have moved since, stay current);
        returns the gradients that were there, for ``restore_grads``."""
        options = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        # Clones: load_state_dict keeps the tensors it is given, and the buffers are reused.
        leaves = [x.clone() if isinstance(x, torch.Tensor) else x for x in self._state_leaves]
        optimizer.load_state_dict(tree_unflatten(leaves, self._state_spec))
        for group, current in zip(optimizer.param_groups, options):
            group.update(current)
        current_grads = []
        for tensor, param, grad in zip(self.tensors, self.params, self.grads):
            tensor.copy_(param)
            current_grads.append(None if tensor.grad is None else tensor.grad.clone())
            if grad is None:
                tensor.grad = None
            elif tensor.grad is None:
                tensor.grad = grad.clone()
            else:  # in place: gradients may be views of data-parallel buckets
                tensor.grad.copy_(grad)
        return current_grads

    @torch.no_grad()
    def restore_grads(self, grads: List[Optional[torch.Tensor]]) -> None:
        for tensor, grad in zip(self.tensors, grads):
            if grad is None:
                tensor.grad = None
            else:
                tensor.grad.copy_(grad)
