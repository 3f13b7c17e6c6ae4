"""Data-parallel gradient reduction: bucketed, launched as soon as a bucket's gradients are
final, so the all-reduce of late layers overlaps the backward of early ones.

Gradients live in flat per-bucket buffers (each parameter's .grad is a view), so autograd
accumulates microbatch gradients straight into what gets reduced. A bucket is launched when
every parameter in it has received its expected number of gradient accumulations for the
step: counted by autograd's post-accumulate-grad hooks, and by `grad_ready(param)` for
gradients written outside autograd (the deferred weight gradients of zero-bubble schedules,
which are final only after their W pass, not after I). `finish()` launches whatever is left
and waits, so a miscount can cost overlap but never correctness.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional

import torch
import torch.distributed as dist

from torchpp import _C
from torchpp.parallel.backward_groups import pass_group

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024


@dataclass
class _Bucket:
    params: List[torch.nn.Parameter]
    buffer: torch.Tensor
    pending: int = 0
    work: Optional[dist.Work] = None
    launched_early: bool = False


@dataclass
class OverlapStats:
    """How many buckets were launched before finish() (their reduction overlapped compute)."""

    buckets: int = 0
    launched_early: int = 0
    bytes_early: int = 0
    bytes_total: int = 0
    extra: Dict[str, float] = field(default_factory=dict)


def bucket_members(params: List[torch.nn.Parameter], bucket_bytes: int) -> List[List[torch.nn.Parameter]]:
    """`params` cut, in order, into runs of one dtype and device of about `bucket_bytes` each."""
    buckets, current, current_bytes = [], [], 0
    for param in params:
        same_kind = not current or (param.dtype == current[0].dtype and param.device == current[0].device)
        if current and (current_bytes >= bucket_bytes or not same_kind):
            buckets.append(current)
            current, current_bytes = [], 0
        current.append(param)
        current_bytes += param.numel() * param.element_size()
    if current:
        buckets.append(current)
    return buckets


class GradReducer:
    """Averages the gradients of `params` over the data-parallel `group`, bucket by bucket.

    Args:
        params: the parameters to reduce (one stage's, or a whole model's).
        group: the data-parallel ProcessGroup.
        bucket_bytes: target bucket size.
        accumulations_per_step: how many gradient accumulations a parameter receives per
            optimizer step (the number of microbatches whose backward touches it); 0 means
            unknown: nothing launches early and finish() reduces everything.
        hold: parameters whose gradients change after backward (tied embeddings summed over
            stages); their buckets wait for finish(). Parameters flagged sequence_parallel
            (summed over TP after backward) are held too.
        average_over: the replicas the summed gradients are divided by (default: the group's
            size). Over the dp x cp group it is dp: context-parallel ranks hold parts of one
            replica's gradient, which are summed, not averaged.
    """

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        group: dist.ProcessGroup,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        accumulations_per_step: int = 1,
        hold: Iterable[torch.nn.Parameter] = (),
        average_over: Optional[int] = None,
    ):
        self.group = group
        self.size = group.size()
        self.average_over = average_over or self.size
        self.accumulations_per_step = accumulations_per_step
        params = [p for p in params if p.requires_grad]
        # Reverse registration order approximates the order in which backward finishes them.
        self.buckets = self._make_buckets(list(reversed(params)), bucket_bytes)
        self._bucket_of: Dict[int, _Bucket] = {}
        self._counts: Dict[int, int] = {}
        self._hooks = []
        for bucket in self.buckets:
            for param in bucket.params:
                self._bucket_of[id(param)] = bucket
                self._hooks.append(param.register_post_accumulate_grad_hook(self._on_accumulated))
        # Gradients completed after backward wait for finish(): sequence-parallel ones (summed
        # over TP) and DualPipe's (summed with the twin stage's on another rank).
        self._held = {id(p) for p in hold} | {id(p) for p in params if getattr(p, "sequence_parallel", False)
                                              or getattr(p, "grad_summed_after_backward", False)}
        self.stats = OverlapStats()
        self.zero_grad()

    def _make_buckets(self, params, bucket_bytes) -> List[_Bucket]:
        made = []
        for members in bucket_members(params, bucket_bytes):
            buffer = torch.zeros(sum(p.numel() for p in members), dtype=members[0].dtype, device=members[0].device)
            offset = 0
            for param in members:
                param.grad = buffer[offset : offset + param.numel()].view_as(param)
                offset += param.numel()
            made.append(_Bucket(members, buffer))
        return made

    def zero_grad(self) -> None:
        """Zeroes the gradient buffers and restarts the per-step accumulation counts."""
        for bucket in self.buckets:
            self.wait_bucket(bucket)
            bucket.buffer.zero_()
            bucket.pending = len(bucket.params)
            bucket.launched_early = False
            offset = 0
            for param in bucket.params:  # an optimizer's zero_grad(set_to_none) may have dropped the view
                param.grad = bucket.buffer[offset : offset + param.numel()].view_as(param)
                offset += param.numel()
        self._counts = {id(p): 0 for b in self.buckets for p in b.params}

    def _on_accumulated(self, param: torch.Tensor) -> None:
        # A split-B/W linear's I pass reaches AccumulateGrad without a gradient (it parked the
        # weight gradient); the hook fires again, from C++, when the W pass delivers it.
        if _C.wgrad_parked_for(param) > 0 and not _C.wgrad_in_deferred_accumulate():
            return
        self.grad_ready(param)

    def grad_ready(self, param: torch.Tensor) -> None:
        """Counts one gradient accumulation into `param`; launches its bucket when complete."""
        key = id(param)
        if key not in self._counts or key in self._held or self.accumulations_per_step <= 0:
            return
        self._counts[key] += 1
        if self._counts[key] == self.accumulations_per_step:
            bucket = self._bucket_of[key]
            bucket.pending -= 1
            if bucket.pending == 0 and bucket.work is None:
                bucket.launched_early = True
                self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        # From a backward hook: under the pipeline's forward-backward overlap, the backward's twin group.
        bucket.work = dist.all_reduce(bucket.buffer, group=pass_group(self.group), async_op=True)

    def wait_bucket(self, bucket: _Bucket) -> None:
        if bucket.work is not None:
            bucket.work.wait()
            bucket.work = None
            bucket.buffer.div_(self.average_over)

    def finish(self) -> OverlapStats:
        """Launches the buckets still pending, waits for all, and leaves averaged gradients."""
        stats = OverlapStats(buckets=len(self.buckets))
        for bucket in self.buckets:
            nbytes = bucket.buffer.numel() * bucket.buffer.element_size()
            stats.bytes_total += nbytes
            if bucket.launched_early:
                stats.launched_early += 1
                stats.bytes_early += nbytes
            if bucket.work is None and not bucket.launched_early:
                self._launch(bucket)
        for bucket in self.buckets:
            self.wait_bucket(bucket)
        # The next accumulation starts a new step only after zero_grad().
        for bucket in self.buckets:
            bucket.launched_early = True
        self.stats = stats
        return stats

    def remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
