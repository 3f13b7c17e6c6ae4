"""ZeRO stages 1 to 3: optimizer state (1), gradients (2) and parameters (3) sharded over the
data-parallel group.

Parameters (per dtype) are packed into one flat buffer padded to a multiple of the DP size;
each model parameter and its .grad become views of flat buffers. A step reduce-scatters the
gradients (each rank receives the average of its 1/dp shard), runs the wrapped optimizer on
the shard only, and all-gathers the updated parameters. The optimizer sees, for every model
parameter that overlaps this rank's shard, one leaf tensor viewing that overlap, so any
per-parameter torch.optim optimizer works, param groups (e.g. no weight decay for norms)
included, and its state is 1/dp of the unsharded state.

Stages 2 and 3 pack parameters into buckets (one flat buffer each) instead of one buffer per
dtype, so each bucket's gradient is reduce-scattered as soon as backward has finished it
(torchpp/parallel/zero_grads.py) and its full gradient is freed. Stage 3 keeps each rank's
parameter shard in a tensor of its own (what the optimizer updates) and the full bucket only
while it is in use: gathered before the first forward that needs it (and the next bucket's gather launched
then, a prefetch), released once its gradient is final (so under a pipeline it stays gathered
across the step's microbatches).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional

import torch
import torch.distributed as dist

from torchpp.parallel.collectives_compat import all_gather_single, reduce_scatter_single
from torchpp.parallel.data_parallel import bucket_members


@dataclass
class _Segment:
    param: torch.nn.Parameter  # the model parameter
    shard_view: torch.nn.Parameter  # the optimizer's leaf: a view of this rank's part of it
    flat_lo: int
    flat_hi: int
    param_lo: int = 0  # where the segment starts in the flattened parameter (for checkpoints)


@dataclass
class GatheredBuckets:
    """ZeRO-3: how many buckets are gathered now, and the most at once since ``peak`` was reset."""

    now: int = 0
    peak: int = 0


class _FlatGroup:
    """Parameters of one dtype/device (all of them, or one bucket), packed into flat parameter
    and gradient buffers. ``shard_params`` (ZeRO-3): this rank's part of the parameters lives in
    ``param_shard``, and the full ``flat_param`` is allocated only while gathered."""

    def __init__(self, params: List[torch.nn.Parameter], group, shard_params: bool = False,
                 live: Optional[GatheredBuckets] = None):
        self.group = group  # the ranks sharing these parameters' shards (dp, or expert-dp for experts)
        dp_size, dp_rank = group.size(), dist.get_rank(group)
        numel = sum(p.numel() for p in params)
        padded = -(-numel // dp_size) * dp_size
        dtype, device = params[0].dtype, params[0].device
        self.params = params
        self.flat_param = torch.zeros(padded, dtype=dtype, device=device)
        self.flat_grad = torch.zeros(padded, dtype=dtype, device=device)
        self.shard_size = padded // dp_size
        self.shard_lo = dp_rank * self.shard_size
        self.grad_shard = torch.zeros(self.shard_size, dtype=dtype, device=device)
        self.offsets = {}
        offset = 0
        for param in params:
            n = param.numel()
            self.flat_param[offset : offset + n].copy_(param.detach().reshape(-1))
            param.data = self.flat_param[offset : offset + n].view_as(param)
            param.grad = self.flat_grad[offset : offset + n].view_as(param)
            self.offsets[id(param)] = (offset, offset + n)
            offset += n
        self.param_shard: Optional[torch.Tensor] = None
        self.gathered = True
        self.gathers = 0
        self.prefetches = 0  # of the gathers, those launched ahead of their module (see gather_params_of)
        self.work: Optional[dist.Work] = None
        self.live = live if live is not None else GatheredBuckets()
        if shard_params:
            self.param_shard = self.flat_param[self.shard_lo : self.shard_lo + self.shard_size].clone()
            self.flat_param.untyped_storage().resize_(0)  # never counted as gathered
            self.gathered = False

    @torch.no_grad()
    def gather(self, group, async_op: bool = False) -> None:
        """ZeRO-3: allocates the full parameters again and all-gathers them from the shards
        (``async_op``: launched only, a prefetch; the next gather() or release() waits)."""
        if self.gathered:
            if self.work is not None and not async_op:
                self.work.wait()
                self.work = None
            return
        self.flat_param.untyped_storage().resize_(self.flat_param.numel() * self.flat_param.element_size())
        self.work = all_gather_single(self.flat_param, self.param_shard, group=group, async_op=True)
        self.gathered = True
        self.gathers += 1
        self.live.now += 1
        self.live.peak = max(self.live.peak, self.live.now)
        self.prefetches += int(async_op)
        if not async_op:
            self.work.wait()
            self.work = None

    def release(self) -> None:
        """ZeRO-3: frees the full parameters (the model's parameters keep their shapes, with no storage)."""
        if self.param_shard is not None and self.gathered:
            if self.work is not None:  # a prefetch still writing into the buffer
                self.work.wait()
                self.work = None
            self.flat_param.untyped_storage().resize_(0)
            self.gathered = False
            self.live.now -= 1

    def segments(self) -> List[_Segment]:
        lo, hi = self.shard_lo, self.shard_lo + self.shard_size
        segments = []
        for param in self.params:
            start, end = self.offsets[id(param)]
            a, b = max(start, lo), min(end, hi)
            if a >= b:
                continue
            source = self.flat_param[a:b] if self.param_shard is None else self.param_shard[a - lo : b - lo]
            view = torch.nn.Parameter(source, requires_grad=True)  # shares storage
            view.grad = self.grad_shard[a - lo : b - lo]
            segments.append(_Segment(param, view, a, b, param_lo=a - start))
            param.zero_param_lo = a - start  # one segment per parameter and rank: the norm finds its rows by it
        return segments

    def restore_grad_views(self) -> None:
        for param in self.params:
            start, end = self.offsets[id(param)]
            param.grad = self.flat_grad[start:end].view_as(param)


class ZeroRedundancyOptimizer:
    """Wraps a torch.optim optimizer class so its state is sharded over `dp_group` (ZeRO-1;
    with ``bucket_bytes``, the layout of ZeRO-2 and, with ``shard_params``, ZeRO-3).

    Args:
        params: model parameters, or param-group dicts as for any torch.optim optimizer.
        optimizer_class: e.g. torch.optim.AdamW; must update each parameter independently.
        dp_group: the data-parallel ProcessGroup (with context parallelism: the dp x cp group,
            over which Megatron's distributed optimizer shards too).
        average_over: the replicas the summed gradients are divided by (default: the group's
            size; dp over the dp x cp group, whose cp ranks hold parts of one sum).
        bucket_bytes: pack parameters (in reverse order, as backward finishes them) into buckets of
            about this size, each padded to a multiple of dp (ZeRO-2/3); None: one buffer per dtype.
        shard_params: ZeRO-3: keep only this rank's parameter shard between uses (see gather()).
        expert_dp_group: with expert parallelism, the ranks holding this rank's experts: expert
            parameters (``param.expert_parallel``) are sharded and reduced over it instead (ZeRO-1).
        **defaults: the optimizer's keyword arguments (lr, weight_decay, ...).

    Use as an optimizer: loss.backward(); opt.step(); opt.zero_grad(). step() does the
    reduce-scatter (averaging over dp) and the all-gather itself: do not all-reduce gradients
    before it.
    """

    def __init__(self, params: Iterable, optimizer_class: Callable[..., torch.optim.Optimizer], dp_group,
                 average_over: Optional[int] = None, *, bucket_bytes: Optional[int] = None,
                 shard_params: bool = False, expert_dp_group=None, **defaults):
        self.dp_group = dp_group
        self.dp_size, self.dp_rank = dp_group.size(), dist.get_rank(dp_group)
        self.average_over = average_over or self.dp_size
        groups = list(params)
        if groups and not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        all_params: List[torch.nn.Parameter] = []
        options_of: Dict[int, Dict[str, Any]] = {}
        for group in groups:
            for param in group["params"]:
                if param.requires_grad and id(param) not in options_of:
                    all_params.append(param)
                    options_of[id(param)] = {k: v for k, v in group.items() if k != "params"}
        # Expert parameters (expert parallelism) are shared by the expert-data-parallel ranks only.
        is_expert = lambda p: expert_dp_group is not None and getattr(p, "expert_parallel", None) is not None  # noqa: E731
        if bucket_bytes is not None and any(is_expert(p) for p in all_params):
            raise NotImplementedError("torchpp ZeRO-2/3 does not shard expert-parallel parameters yet; use zero=1")
        by_kind: Dict[tuple, List[torch.nn.Parameter]] = {}
        for param in all_params:
            by_kind.setdefault((param.dtype, param.device, is_expert(param)), []).append(param)
        if bucket_bytes is not None:
            packs = [(dp_group, members) for members in bucket_members(list(reversed(all_params)), bucket_bytes)]
        else:
            packs = [(expert_dp_group if expert else dp_group, ps) for (_, _, expert), ps in by_kind.items()]
        self.shard_params = shard_params
        self.gathered_buckets = GatheredBuckets()  # ZeRO-3's live count (what reshard_after_forward lowers)
        self.flat_groups = [_FlatGroup(ps, group, shard_params, self.gathered_buckets) for group, ps in packs]
        self._group_of = {id(p): flat for flat in self.flat_groups for p in flat.params}
        self._index_of = {id(flat): k for k, flat in enumerate(self.flat_groups)}
        self.segments: List[_Segment] = [s for g in self.flat_groups for s in g.segments()]

        # One optimizer param group per distinct option set, holding this rank's segments.
        opt_groups: List[Dict[str, Any]] = []
        for segment in self.segments:
            options = options_of[id(segment.param)]
            for group in opt_groups:
                if {k: v for k, v in group.items() if k != "params"} == options:
                    group["params"].append(segment.shard_view)
                    break
            else:
                opt_groups.append({"params": [segment.shard_view], **options})
        if not opt_groups:  # a rank whose shard holds only padding still needs a valid optimizer
            placeholder = torch.nn.Parameter(torch.zeros(0, dtype=all_params[0].dtype, device=all_params[0].device))
            placeholder.grad = torch.zeros_like(placeholder)
            opt_groups = [{"params": [placeholder]}]
        self.optimizer = optimizer_class(opt_groups, **defaults)
        self.param_groups = self.optimizer.param_groups

    def reduce_scatter_grads(self) -> None:
        """Each rank receives the DP-average of its shard of the gradients."""
        for flat in self.flat_groups:
            reduce_scatter_single(flat.grad_shard, flat.flat_grad, group=flat.group)
            flat.grad_shard.div_(self.average_over)

    def shard_grads(self) -> List[torch.Tensor]:
        """This rank's reduced gradient shards (after reduce_scatter_grads)."""
        return [s.shard_view.grad for s in self.segments]

    @torch.no_grad()
    def step(self, closure=None, *, grads_reduced: bool = False):
        if not grads_reduced:
            self.reduce_scatter_grads()
        loss = self.optimizer.step(closure)
        self.all_gather_params()
        return loss

    @torch.no_grad()
    def all_gather_params(self) -> None:
        """Every rank's parameters from the shards their owners hold (ZeRO-3: released instead,
        to be gathered by the next use)."""
        for flat in self.flat_groups:
            if flat.param_shard is not None:
                flat.release()
                continue
            shard = flat.flat_param[flat.shard_lo : flat.shard_lo + flat.shard_size].clone()
            all_gather_single(flat.flat_param, shard, group=flat.group)

    def gather_params_of(self, params: Iterable[torch.Tensor], prefetch: bool = False) -> None:
        """ZeRO-3: gathers every bucket holding one of `params` (collective over dp: every rank
        must ask for the same buckets in the same order, as identical forwards do).
        ``prefetch``: also launch the gather of the bucket the forward reaches next."""
        last = None
        for param in params:
            flat = self._group_of.get(id(param))
            if flat is not None:
                flat.gather(flat.group)
                last = flat
        if prefetch and last is not None:
            # Buckets are packed in reverse parameter order: the forward meets them backwards.
            index = self._index_of[id(last)]
            if index > 0:
                self.flat_groups[index - 1].gather(self.flat_groups[index - 1].group, async_op=True)

    def release_params_of(self, params: Iterable[torch.Tensor]) -> None:
        """ZeRO-3: releases every bucket holding one of `params` (local: no collective)."""
        for param in params:
            flat = self._group_of.get(id(param))
            if flat is not None:
                flat.release()

    @property
    def gathers(self) -> int:
        """ZeRO-3: all-gathers of parameter buckets so far."""
        return sum(flat.gathers for flat in self.flat_groups)

    @property
    def prefetches(self) -> int:
        """ZeRO-3: of the gathers, those launched ahead of the forward that needed them."""
        return sum(flat.prefetches for flat in self.flat_groups)

    def gather_all_params(self) -> None:
        """ZeRO-3: gathers every bucket (e.g. before saving or evaluating the whole model)."""
        for flat in self.flat_groups:
            flat.gather(flat.group)

    @torch.no_grad()
    def keep_loaded_params(self) -> None:
        """ZeRO-3: takes this rank's shards from the gathered parameters (after values were
        written into them, e.g. by a checkpoint load) and releases the full ones."""
        for flat in self.flat_groups:
            if flat.param_shard is not None and flat.gathered:
                flat.param_shard.copy_(flat.flat_param[flat.shard_lo : flat.shard_lo + flat.shard_size])
                flat.release()

    def release_all_params(self) -> None:
        for flat in self.flat_groups:
            flat.release()

    def zero_grad(self, set_to_none: bool = False) -> None:
        del set_to_none  # gradients are views of flat buffers and must stay allocated
        for flat in self.flat_groups:
            flat.flat_grad.zero_()
            flat.grad_shard.zero_()
            flat.restore_grad_views()

    def state_dict(self) -> Dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)

    def state_bytes(self) -> int:
        """Bytes of optimizer state on this rank (what ZeRO-1 divides by dp)."""
        total = 0
        for state in self.optimizer.state.values():
            for value in state.values():
                if torch.is_tensor(value):
                    total += value.numel() * value.element_size()
        return total
