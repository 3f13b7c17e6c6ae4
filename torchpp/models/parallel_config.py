"""What ``parallelize`` is asked to do: the parallel sizes plus one option object per feature.

    config = ParallelConfig(pp=2, pipeline=PipelineOptions(schedule="zb-h1", n_microbatches=8),
                            recompute="selective")
    model = parallelize(model, config, state=state)
    model = parallelize(model, schedule="zb-h1", n_microbatches=8, recompute="selective")  # the same

Each pass of ``parallelize`` (``torchpp.models.passes``) reads its own option object; the
keywords ``parallelize`` took before the config existed (``KEYWORDS``) still work and map to
the fields below.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple, Union

from torchpp.parallel.zero_params import zero_stage
from torchpp.recompute import check_recompute_mode


@dataclass
class TensorOptions:
    """Tensor and sequence parallelism.

    Attributes:
        sequence_parallel: the residual stream and norms hold sequence slices (Megatron-3).
        vocab_parallel_logits: (transformers causal LMs, pp=1) return each rank's vocabulary
            slice of the logits and compute the loss on the slices.
    """

    sequence_parallel: bool = False
    vocab_parallel_logits: bool = False


@dataclass
class PipelineOptions:
    """The pipeline cut and its schedule (pp > 1).

    Attributes:
        schedule: pipeline schedule name (torchpp.schedule.SCHEDULES). DualPipe runs two
            pipelines in opposite directions: rank r holds model stages r and p-1-r, ``step``
            sums each stage's gradients over its two ranks, and both end ranks hold the loss.
        n_microbatches: microbatches per step (default: pp).
        split: first layer index of each model stage after the first; default even; "auto": a
            quick profile and torchpp.plan's partitioner choose it, and the cost-aware schedules
            (zb-auto, zb-v) are generated on the profiled per-stage F, I and W times.
        split_bw: whether the plain ``nn.Linear`` layers the plan leaves unsharded (and any
            ``nn.MultiheadAttention``) run their backward split into I and W
            (``PipelineStage(split_bw=)``): None (default) on under schedules with W passes;
            False keeps their backward in I.
        overlap_forward_backward: run each forward and the backward of another microbatch next
            to it in the schedule at once (DualPipe's overlapped pairs), so the experts'
            all-to-all of one waits while the other computes (torchpp.expert_parallel.overlap).
            None (default): on under dualpipe / dualpipe-v with ep > 1 on CPU when tp = cp = 1
            and zero <= 1; True insists (errors name what stands in the way); False: off.
    """

    schedule: str = "1f1b"
    n_microbatches: Optional[int] = None
    split: Optional[Union[Sequence[int], str]] = None
    split_bw: Optional[bool] = None
    overlap_forward_backward: Optional[bool] = None


@dataclass
class ContextOptions:
    """Context parallelism (cp > 1, transformers causal LMs; torchpp.context_parallel).

    Attributes:
        mode: "ring" (key/value shards passed around the ring, overlapping compute),
            "all-gather", "all-to-all" (heads traded for the sequence, DeepSpeed-Ulysses: cp
            must divide each tensor-parallel rank's heads) or "all-to-all+ring" (hierarchical,
            Megatron's "a2a+p2p": all-to-all inside groups of ``all_to_all_size`` consecutive cp
            ranks, which must divide each tensor-parallel rank's heads; the ring across them).
        layout: "zigzag" (rank r holds chunks r and 2c-1-r of 2c: causal work balanced) or
            "contiguous".
        all_to_all_size: mode "all-to-all+ring"'s group size a (a divisor of cp; with the default
            rank order "tp-cp-dp-pp", tp * a ranks per node keep each all-to-all inside a node).
    """

    mode: str = "ring"
    layout: str = "zigzag"
    all_to_all_size: Optional[int] = None

    def __post_init__(self):
        if self.all_to_all_size is not None and self.mode != "all-to-all+ring":
            raise ValueError(f"torchpp.parallelize: cp_all_to_all_size={self.all_to_all_size} sizes the all-to-all "
                             f"groups of cp_mode='all-to-all+ring', not of cp_mode={self.mode!r}")
        if self.mode == "all-to-all+ring" and self.all_to_all_size is None:
            raise ValueError("torchpp.parallelize: cp_mode='all-to-all+ring' needs cp_all_to_all_size, the number of "
                             "consecutive cp ranks (one node's) that trade heads by all-to-all")


@dataclass
class ExpertOptions:
    """Expert parallelism (ep > 1; torchpp.expert_parallel).

    Attributes:
        capacity_factor: None (dropless, default) or each expert's capacity as a factor of an
            even share of a rank's routed pairs; dropped pairs per experts module:
            ``model.ep_dropped``.
        tensor_parallel: with tp > 1 and ep > 1, also split each expert over TP (the TP plan's
            expert entries); default False: whole experts, replicated over TP.
    """

    capacity_factor: Optional[float] = None
    tensor_parallel: bool = False


@dataclass
class ParallelConfig:
    """Everything ``parallelize`` is asked for.

    Attributes:
        tp, pp, cp, ep: parallel sizes (default: the parallel state's; given with a state, they
            must agree with it).
        plan: a dict of module/parameter-name globs to style names
            (``torchpp.tensor_parallel.styles.STYLES``), or {"tp": {...}, "pp": {...}} where the
            pp part names the stack of layers (transformers' form, or module names in the order
            they run); "auto": derived from the module structure (``torchpp.models.auto_plan``).
            Default: the transformers model's own plans.
        recompute: None, "full" (checkpoint each layer) or, for transformers models,
            "selective" (recompute the attention function: the s x s scores and probabilities).
        zero: the ZeRO stage (0..3; True is 1) that ``DistributedOptimizer(model, ...)`` then
            applies over dp (``model.zero_stage``).
        grad_scaler: fp16 loss scaling (torchpp.parallel.GradScaler); give it to
            DistributedOptimizer too.
        loss_fn: ``loss_fn(output, target)`` of ``step`` for a model that is not a transformers
            causal LM.
        tensor, pipeline, context, experts: each feature's options.
    """

    tp: Optional[int] = None
    pp: Optional[int] = None
    cp: Optional[int] = None
    ep: Optional[int] = None
    plan: Optional[Union[Mapping, str]] = None
    recompute: Optional[str] = None
    zero: Union[bool, int] = 0
    grad_scaler: Any = None
    loss_fn: Optional[Callable] = None
    tensor: TensorOptions = field(default_factory=TensorOptions)
    pipeline: PipelineOptions = field(default_factory=PipelineOptions)
    context: ContextOptions = field(default_factory=ContextOptions)
    experts: ExpertOptions = field(default_factory=ExpertOptions)

    def __post_init__(self):
        check_recompute_mode(self.recompute)
        self.zero = zero_stage(self.zero)
        self.context.__post_init__()  # (its fields may have been set one by one, by parallelize's keywords)

    @classmethod
    def from_keywords(cls, config: Optional["ParallelConfig"] = None, **keywords) -> "ParallelConfig":
        """``config`` (default: all defaults) with ``parallelize``'s keywords (``KEYWORDS``) set on it."""
        if config is not None and not isinstance(config, ParallelConfig):
            raise TypeError(f"torchpp.parallelize: config must be a ParallelConfig, got {type(config).__name__} "
                            f"(sizes and options go by keyword: tp=, pp=, schedule=, ...)")
        config = copy_config(config or cls())
        unknown = sorted(set(keywords) - set(KEYWORDS))
        if unknown:
            raise TypeError(f"torchpp.parallelize: unknown keyword(s) {unknown}; known: {sorted(KEYWORDS)}")
        for keyword, value in keywords.items():
            group, name = KEYWORDS[keyword]
            setattr(getattr(config, group) if group else config, name, value)
        config.__post_init__()
        return config


def copy_config(config: ParallelConfig) -> ParallelConfig:
    """A copy whose option objects are copies too (setting one leaves the original alone)."""
    groups = {f.name: dataclasses.replace(getattr(config, f.name)) for f in dataclasses.fields(config)
              if dataclasses.is_dataclass(getattr(config, f.name))}
    return dataclasses.replace(config, **groups)


# parallelize's keywords -> (option group, field): the names parallelize took before ParallelConfig.
KEYWORDS: Dict[str, Tuple[str, str]] = {
    **{name: ("", name) for name in ("tp", "pp", "cp", "ep", "plan", "recompute", "zero", "grad_scaler", "loss_fn")},
    "sequence_parallel": ("tensor", "sequence_parallel"),
    "vocab_parallel_logits": ("tensor", "vocab_parallel_logits"),
    "schedule": ("pipeline", "schedule"),
    "n_microbatches": ("pipeline", "n_microbatches"),
    "split": ("pipeline", "split"),
    "split_bw": ("pipeline", "split_bw"),
    "overlap_forward_backward": ("pipeline", "overlap_forward_backward"),
    "cp_mode": ("context", "mode"),
    "cp_layout": ("context", "layout"),
    "cp_all_to_all_size": ("context", "all_to_all_size"),
    "capacity_factor": ("experts", "capacity_factor"),
    "expert_tensor_parallel": ("experts", "tensor_parallel"),
}
