"""What the passes of ``parallelize`` learn about a model as they go (each pass reads what the
earlier ones recorded and adds its own)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

from torch import nn

from torchpp.models.stages import ModelStage, PipelineLayout
from torchpp.parallel.groups import ParallelState
from torchpp.tensor_parallel.styles import TPContext


@dataclass
class Placement:
    """Where the model stages live (pp=1: one stage, on this rank).

    Attributes:
        num_stages: model stages (pp x stages per rank; DualPipe: each held twice).
        mine: the model stages this rank holds.
        rank_of: pipeline rank of every model stage (DualPipe: its pipeline-0 copy's).
        num_pipelines: 2 under DualPipe, else 1.
        n_microbatches: microbatches per step.
    """

    num_stages: int = 1
    mine: List[int] = field(default_factory=lambda: [0])
    rank_of: Dict[int, int] = field(default_factory=lambda: {0: 0})
    num_pipelines: int = 1
    n_microbatches: int = 1


@dataclass
class WrapState:
    """The parallel state plus what the passes found and built.

    Attributes:
        parallel: the process groups and sizes (``torchpp.init_parallel``).
        hf: a transformers model.
        causal_lm: a transformers causal LM (it has an output embedding).
        tp_plan: full module-name glob -> style name.
        strict: a user's plan (every glob must match).
        layout: where a pipeline cuts the model (its stack of layers), or None.
        fixups: a family's own changes after its TP plan is applied, or None.
        ep_plan: the expert-parallel plan, or None.
        tp_context: what the TP styles need (group, head counts, sequence parallelism).
        layer_contexts: {layer path: its TP context} where a layer's head counts differ from
            the model-wide ones (transformers' heterogeneous configs).
        placement: the pipeline placement.
        overlap: (overlap forward and backward, the groups a failing step breaks).
        tied: parameters held by more than one module, before the cut.
        tied_across: those held by a first-stage and a last-stage module (``resolve.tied_across_ends``).
        tied_layers: those held by layers on several pipeline ranks (``pipeline_cut.tied_across_layers``).
        tied_names: {second name of a tied parameter: its first name}.
        stages: this rank's pipeline stages by model stage index.
        stage_costs: split="auto": the profiled per-stage F, I, W times the cost-aware
            schedules (zb-auto, zb-v) are generated on; else None.
        context: the ContextParallel of cp > 1, else None.
        cp_positions: cp > 1: how the whole model counts its positions (context_parallel.positions),
            decided before the pipeline cut.
        ep_context: the EPContext of ep > 1, else None.
        weights_pending: built on the meta device and not loaded yet.
        loss_shifts_labels: the model's loss is transformers' causal one (else each token's
            logits meet its own label); read under a pipeline, whose last stage computes it, and
            under cp, where torchpp computes a per-token loss itself.
    """

    parallel: ParallelState
    hf: bool = False
    causal_lm: bool = False
    tp_plan: Dict[str, str] = field(default_factory=dict)
    strict: bool = False
    layout: Optional[PipelineLayout] = None
    fixups: Optional[Callable[[nn.Module, TPContext], None]] = None
    ep_plan: Any = None
    tp_context: Optional[TPContext] = None
    layer_contexts: Dict[str, TPContext] = field(default_factory=dict)
    placement: Placement = field(default_factory=Placement)
    overlap: Tuple[bool, list] = (False, [])
    tied: List[nn.Parameter] = field(default_factory=list)
    tied_across: List[nn.Parameter] = field(default_factory=list)
    tied_layers: List[nn.Parameter] = field(default_factory=list)
    tied_names: Dict[str, str] = field(default_factory=dict)
    stages: Dict[int, ModelStage] = field(default_factory=dict)
    stage_costs: Any = None
    context: Any = None
    cp_positions: Any = None
    ep_context: Any = None
    weights_pending: bool = False
    loss_shifts_labels: bool = True
