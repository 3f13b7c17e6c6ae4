"""Optimizer post-validation (zero-bubble paper, section 4): update now, check the global norm later.

Clipping by the global gradient norm needs an all-reduce over every pipeline stage before
any rank may update, so the ranks that finish their backward first wait for the last one:
under ZB-H2 that wait is the bubble the schedule removed. Post-validation updates at once as
if no clipping were needed, while the norm's all-reduce runs in the background, and checks it
at the next step. Clipping rarely triggers in stable training; when it does, the update is
rolled back from a copy and redone with the clipped gradients, and the batch whose gradients
came from the speculative parameters runs again. Every rank reaches the same verdict, so they
roll back together, and the trajectory is exactly the synchronous one.

With fp16 loss scaling the inf/NaN check is post-validated the same way: the update and the
scale's update assume no overflow while the check is all-reduced, and an overflow found later
undoes the update (the synchronous step would have been skipped), backs the scale off and
runs the next batch again, with the parameters and the scale it should have had.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_unflatten

from torchpp.parallel.grad_scaler import GradScaler


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


def current_options(optimizer: torch.optim.Optimizer) -> List[dict]:
    """Each param group's options (lr, betas, ...), without its parameters."""
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def restore_options(optimizer: torch.optim.Optimizer, options: List[dict]) -> None:
    for group, saved in zip(optimizer.param_groups, options):
        group.update(saved)


class SpeculativeStep:
    """What undoes one speculative update: copies of the parameters, gradients and optimizer
    state it started from (and the loss scale's), and the in-flight all-reduces of the
    gradients' squared norm (and of the inf/NaN flag)."""

    def __init__(self, optimizer: torch.optim.Optimizer, squared_norm: torch.Tensor,
                 group: Optional[dist.ProcessGroup], buffers: BackupBuffers,
                 grad_scaler: Optional[GradScaler] = None, found_inf: Optional[torch.Tensor] = None):
        self.tensors: List[torch.Tensor] = [p for g in optimizer.param_groups for p in g["params"]]
        self.params = buffers.copy("params", self.tensors)
        self.grads = buffers.copy("grads", [p.grad for p in self.tensors])
        leaves, self._state_spec = tree_flatten(optimizer.state_dict())
        tensors = buffers.copy("state", [x if isinstance(x, torch.Tensor) else None for x in leaves])
        self._state_leaves = [t if isinstance(x, torch.Tensor) else x for x, t in zip(leaves, tensors)]
        self.squared_norm = squared_norm
        self.work = dist.all_reduce(squared_norm, group=group, async_op=True) if group is not None else None
        self.grad_scaler, self._found_inf, self._inf_work = grad_scaler, found_inf, None
        if grad_scaler is not None:
            self._scale_before = grad_scaler.snapshot()
            if dist.is_initialized() and dist.get_world_size(grad_scaler.group) > 1:
                self._inf_work = dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=grad_scaler.group,
                                                 async_op=True)

    def global_norm(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.squared_norm.sqrt()

    def found_inf(self) -> bool:
        """Whether any rank's gradients held an inf or NaN (the update must not have happened)."""
        if self._found_inf is None:
            return False
        if self._inf_work is not None:
            self._inf_work.wait()
            self._inf_work = None
        return bool(self._found_inf.item() > 0)

    def back_off_scale(self) -> None:
        """Replaces the scale's speculative update (no overflow) by the one for an overflow."""
        self.grad_scaler.restore(self._scale_before)
        self.grad_scaler.update_from(torch.ones((), dtype=torch.float32))

    @torch.no_grad()
    def rewind(self, optimizer: torch.optim.Optimizer, keep_options: bool = True) -> List[Optional[torch.Tensor]]:
        """Puts parameters, gradients and optimizer state back as they were before the update
        (param-group options, which an LR scheduler may have moved since, stay current unless
        not `keep_options`: a redo of the update uses the options it had); returns the
        gradients that were there, for ``restore_grads``."""
        options = current_options(optimizer)
        # Clones: load_state_dict keeps the tensors it is given, and the buffers are reused.
        leaves = [x.clone() if isinstance(x, torch.Tensor) else x for x in self._state_leaves]
        optimizer.load_state_dict(tree_unflatten(leaves, self._state_spec))
        if keep_options:
            restore_options(optimizer, options)
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
