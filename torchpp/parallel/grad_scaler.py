"""GradScaler: torch.amp.GradScaler whose inf/NaN verdict is agreed by every rank.

Under fp16 autocast the loss is scaled up so small gradients survive fp16, and a step whose
gradients hold an inf or NaN is skipped while the scale backs off. Each rank of a PTD-P run
sees only its own gradients (its pipeline stages, its TP shards, its ZeRO shard), so a plain
torch.amp.GradScaler lets one rank skip a step that the others take, and their scales drift
apart. This one all-reduces the verdict (MAX) over a group, the world by default, so every
rank skips together and keeps the same scale.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist
from torch.amp.grad_scaler import _refresh_per_optimizer_state


class GradScaler(torch.amp.GradScaler):
    """torch.amp.GradScaler for model-parallel ranks: one skip decision and one scale for all.

    Args:
        device: the device type of the gradients ("cpu", "cuda").
        group: the ranks that must agree (default: the world; every rank that holds part of
            the model or of its optimizer state must be in it).
        init_scale, growth_factor, backoff_factor, growth_interval, enabled: as torch's.

    Used as torch's: ``unscale_`` (to clip), ``step`` and ``update``; or handed to a
    pipeline schedule (``grad_scaler=``, which scales each microbatch's loss seed) and to
    DistributedOptimizer (which unscales, clips, steps or skips, and updates).
    """

    def __init__(self, device: str = "cpu", *, group: Optional[dist.ProcessGroup] = None,
                 init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True):
        super().__init__(device, init_scale=init_scale, growth_factor=growth_factor, backoff_factor=backoff_factor,
                         growth_interval=growth_interval, enabled=enabled)
        self.group = group

    def _unscale_grads_(self, optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor,
                        allow_fp16: bool) -> Dict[torch.device, torch.Tensor]:
        # Both of torch's inf checks (unscale_, and step's for fused optimizers) come through
        # here; torch's ShardedGradScaler hooks the same method.
        per_device = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        agreed = torch.zeros((), dtype=torch.float32, device=found_inf.device)
        for flag in per_device.values():
            agreed += flag.to(agreed.device)
        if dist.is_initialized() and dist.get_world_size(self.group) > 1:
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self.group)
        for flag in per_device.values():
            flag.copy_(agreed)
        if not per_device:  # no gradients here: the verdict still has to reach step() and update()
            per_device[agreed.device] = agreed
        return per_device

    def unscale_locally_(self, optimizer) -> torch.Tensor:
        """Unscales the optimizer's gradients in place and returns this rank's own inf/NaN flag
        (a float32 scalar, not agreed yet): post-validation agrees it in the background."""
        scale, _ = self._check_scale_growth_tracker("unscale_")
        inv_scale = scale.double().reciprocal().float()  # in float64, as torch's unscale_
        template = torch.zeros((), dtype=torch.float32, device=scale.device)
        local = torch.zeros((), dtype=torch.float32, device=scale.device)
        for flag in torch.amp.GradScaler._unscale_grads_(self, optimizer, inv_scale, template, False).values():
            local += flag.to(local.device)
        return local

    def snapshot(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """Copies of the scale and growth tracker, for ``restore``."""
        return tuple(t.clone() for t in self._check_scale_growth_tracker("snapshot"))

    def restore(self, snapshot: Tuple[torch.Tensor, torch.Tensor]) -> None:
        for tensor, saved in zip(self._check_scale_growth_tracker("restore"), snapshot):
            tensor.copy_(saved)

    def update_from(self, found_inf: torch.Tensor) -> None:
        """update() with the verdict given rather than collected by step(): post-validation
        updates as if nothing overflowed and, if the agreed verdict says otherwise, restores
        the snapshot and updates again with it."""
        scale, growth_tracker = self._check_scale_growth_tracker("update")
        torch._amp_update_scale_(scale, growth_tracker, found_inf.to(scale.device, torch.float32),
                                 self._growth_factor, self._backoff_factor, self._growth_interval)
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)

    def found_inf(self, optimizer) -> bool:
        """Whether the agreed check since the last update() found an inf or NaN (the step is skipped)."""
        flags = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        return bool(sum(flag.item() for flag in flags.values()))
