"""ZeRO-2/3 gradient reduction: each bucket is reduce-scattered over dp as soon as its gradient
is final, and its full gradient is freed, so between that moment and the next step's backward
a rank holds only its 1/dp shard of the gradients. A bucket's full gradient is allocated at its
first accumulation of the step (not by zero_grad), so without gradient accumulation only the
buckets that backward is filling exist in full.

"Final" is counted as GradReducer counts it (torchpp/parallel/data_parallel.py): after the
last of ``accumulations_per_step`` accumulations, which under zero-bubble schedules is the W
pass that delivers a deferred weight gradient. Under ZeRO-3 the bucket's full parameters are
released at the same moment: nothing in the rest of the step's backward reads them.

``every_microbatch`` (DeepSpeed's stage-2 behaviour) keeps only the shard across microbatches
too: whenever every parameter of a bucket has received a gradient since the bucket was last
reduced, its full gradient is reduce-scattered into a running shard sum and freed, so under
gradient accumulation (every pipeline) a rank holds the shards plus the buckets backward is
filling, at the cost of one reduce-scatter per bucket per microbatch instead of per step.
Those rounds wait for their reduce-scatter at once (the next microbatch accumulates into the
same buffer), so only the last round overlaps backward.
"""
from __future__ import annotations

from typing import Iterable, List

import torch

from torchpp.parallel.backward_groups import pass_group
from torchpp.parallel.collectives_compat import reduce_scatter_single
from torchpp.parallel.data_parallel import GradReducer, _Bucket
from torchpp.parallel.zero import ZeroRedundancyOptimizer


class ShardedGradReducer(GradReducer):
    """Reduce-scatters the buckets of a bucketed ZeroRedundancyOptimizer (ZeRO-2/3).

    Args:
        optimizer: a ZeroRedundancyOptimizer built with ``bucket_bytes`` (its flat groups are
            the buckets; each parameter's .grad is a view of its bucket's full gradient until
            the bucket is reduce-scattered, then None until zero_grad()).
        accumulations_per_step: gradient accumulations per parameter per step (microbatches).
        hold: parameters whose gradients change after backward (tied embeddings); their
            buckets wait for finish().
    """

    def __init__(self, optimizer: ZeroRedundancyOptimizer, accumulations_per_step: int = 1,
                 hold: Iterable[torch.nn.Parameter] = (), every_microbatch: bool = False):
        self.zero_optimizer = optimizer
        self.every_microbatch = every_microbatch
        self.rounds = 0  # microbatch rounds reduce-scattered before their bucket's last one
        self._in_flight: List[_Bucket] = []  # launched, not yet waited for
        params = [p for flat in reversed(optimizer.flat_groups) for p in reversed(flat.params)]
        super().__init__(params, optimizer.dp_group, 0, accumulations_per_step, hold,
                         average_over=optimizer.average_over)

    def _make_buckets(self, params, bucket_bytes) -> List[_Bucket]:
        del params, bucket_bytes  # the optimizer's flat groups are the buckets
        buckets = []
        for flat in self.zero_optimizer.flat_groups:
            bucket = _Bucket(flat.params, flat.flat_grad)
            bucket.flat = flat
            bucket.untouched = {id(p) for p in flat.params}  # every_microbatch: not accumulated since the last round
            bucket.rounds_sum = None  # every_microbatch: the shard of the rounds reduced so far
            buckets.append(bucket)
        return buckets

    def _on_accumulated(self, param: torch.Tensor) -> None:
        # Runs after AccumulateGrad (and at the I pass of a split-B/W weight, before its W pass
        # writes into .grad): the bucket's full gradient exists from here on.
        self._allocate(self._bucket_of[id(param)].flat)
        super()._on_accumulated(param)

    @staticmethod
    @torch.no_grad()
    def _allocate(flat) -> None:
        grad = flat.flat_grad
        if grad.untyped_storage().nbytes() > 0:
            return
        fresh = [(p, p.grad) for p in flat.params if p.grad is not None]  # AccumulateGrad's first gradient
        grad.untyped_storage().resize_(grad.numel() * grad.element_size())
        grad.zero_()
        flat.restore_grad_views()
        for param, value in fresh:
            param.grad.copy_(value)

    def _launch(self, bucket: _Bucket) -> None:
        flat = bucket.flat
        self._allocate(flat)  # a bucket no gradient reached reduces zeros
        bucket.work = reduce_scatter_single(flat.grad_shard, flat.flat_grad, group=pass_group(self.group),
                                                 async_op=True)
        self._in_flight.append(bucket)

    def wait_bucket(self, bucket: _Bucket) -> None:
        if bucket.work is None:
            return
        bucket.work.wait()
        bucket.work = None
        self._in_flight = [b for b in self._in_flight if b is not bucket]
        flat = bucket.flat
        if bucket.rounds_sum is not None:  # every_microbatch: the earlier rounds' part of the sum
            flat.grad_shard.add_(bucket.rounds_sum)
            bucket.rounds_sum = None
        flat.grad_shard.div_(self.average_over)
        flat.flat_grad.untyped_storage().resize_(0)  # only the shard is kept
        for param in flat.params:
            param.grad = None
        flat.release()  # ZeRO-3: the step's backward is done with these parameters

    def grad_ready(self, param: torch.Tensor) -> None:
        # One bucket in flight: launching the next one first waits for (and frees) the earlier
        # ones, so the full gradients of finished buckets do not pile up during backward.
        earlier = list(self._in_flight)
        super().grad_ready(param)
        if len(self._in_flight) > len(earlier):
            for bucket in earlier:
                self.wait_bucket(bucket)
        if self.every_microbatch:
            self._round_ready(param)

    @torch.no_grad()
    def _round_ready(self, param: torch.Tensor) -> None:
        """every_microbatch: reduces a bucket every parameter of which has a gradient since its
        last round (held buckets wait for finish(); the last round is the step's own launch)."""
        key = id(param)
        bucket = self._bucket_of.get(key)
        if bucket is None or key in self._held or bucket.work is not None or bucket.launched_early:
            return
        bucket.untouched.discard(key)
        if bucket.untouched or any(id(p) in self._held for p in bucket.params):
            return
        flat = bucket.flat
        part = torch.empty_like(flat.grad_shard)
        reduce_scatter_single(part, flat.flat_grad, group=self.group)
        bucket.rounds_sum = part if bucket.rounds_sum is None else bucket.rounds_sum.add_(part)
        flat.flat_grad.untyped_storage().resize_(0)  # the next accumulation allocates it again
        for p in flat.params:
            p.grad = None
        bucket.untouched = {id(p) for p in flat.params}
        self.rounds += 1

    def finish(self):
        stats = super().finish()
        late = [p for b in self.buckets for p in b.params if p.grad is not None]
        if late:
            raise RuntimeError(
                f"torchpp ZeRO-2/3: {len(late)} parameter(s) (first of shape {list(late[0].shape)}) received a gradient "
                f"after their bucket was reduce-scattered: they are accumulated more often than "
                f"accumulations_per_step={self.accumulations_per_step} (give the number of microbatches)")
        return stats

    @torch.no_grad()
    def zero_grad(self) -> None:
        """Frees the full gradient buckets (allocated again by their first accumulation) and
        zeroes the shards for the next step."""
        for bucket in self.buckets:
            self.wait_bucket(bucket)
            flat = bucket.flat
            flat.flat_grad.untyped_storage().resize_(0)
            for param in flat.params:
                param.grad = None
            flat.grad_shard.zero_()
            bucket.rounds_sum = None
            bucket.untouched = {id(p) for p in flat.params}
            bucket.pending = len(bucket.params)
            bucket.launched_early = False
        self._counts = {id(p): 0 for b in self.buckets for p in b.params}
