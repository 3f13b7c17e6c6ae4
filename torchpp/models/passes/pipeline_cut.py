"""The pipeline cut: where the model stages live, and this rank keeping its own (pp > 1).

The stack of layers (``state.layout``) is cut at ``split`` (even by default; "auto": profiled
and partitioned, ``torchpp.models.auto_split``, whose per-stage F, I and W times the
cost-aware schedules are then generated on); the layers and end modules of other ranks'
stages become placeholders, in place (``torchpp.models.stages.cut_in_place``).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

from torch import nn

from torchpp.models.carried_check import check_cut
from torchpp.models.parallel_config import PipelineOptions
from torchpp.models.passes.resolve import tied_across_ends, tied_parameters
from torchpp.models.passes.state import Placement, WrapState
from torchpp.models.stages import PipelineLayout, cut_in_place, get_submodule


def apply_pipeline_cut(model: nn.Module, state: WrapState, options: PipelineOptions) -> nn.Module:
    """Places the model stages (``state.placement``) and, with pp > 1, keeps this rank's
    (``state.stages``), recording the tied parameters first (``state.tied``).

    Args:
        model: the model, cut in place.
        state: reads parallel and layout; fills placement, tied and stages.
        options: schedule, n_microbatches and split.
    """
    ps = state.parallel
    n_microbatches = options.n_microbatches or ps.pp
    state.placement = placement(options.schedule, ps.pp, n_microbatches, ps.pp_rank)
    state.tied = tied_parameters(model)
    if ps.pp == 1:
        return model
    layout, where = state.layout, state.placement
    state.tied_across = tied_across_ends(model, layout.before, layout.after, layout.shared)
    num_layers = len(get_submodule(model, layout.layers))
    split = options.split
    if isinstance(split, str) and split == "auto":
        split, state.stage_costs = _auto_split(model, layout, where.num_stages, ps.pp, where.rank_of)
    bounds = layer_bounds(num_layers, where.num_stages, split)
    check_cut(layout.layers, layout.reads, bounds, layout.reads_inside)
    state.tied_layers = tied_across_layers(model, layout, bounds, where.rank_of, ps.pp)
    summed = {id(p) for p in state.tied_layers}  # over the pipeline: not again between the end stages
    state.tied_across = [p for p in state.tied_across if id(p) not in summed]
    state.stages = cut_in_place(model, layout, bounds, where.mine, state.hf)
    return model


def placement(schedule: str, pp: int, n_microbatches: int, pp_rank: int) -> Placement:
    """The schedule's placement of model stages on pipeline ranks. DualPipe's two pipelines hold
    every model stage twice: rank r holds stages r and p-1-r, and a stage's rank is that of its
    pipeline-0 copy, which owns it."""
    if pp == 1:
        return Placement(n_microbatches=n_microbatches)
    from torchpp import schedule as S

    sch = S.generate(schedule, num_ranks=pp, num_microbatches=n_microbatches)
    rank_of: Dict[int, int] = {}
    for stage, rank in enumerate(sch.stage_to_rank):  # pipeline 0's stages come first
        rank_of.setdefault(sch.model_stage(stage), rank)
    mine = sorted({sch.model_stage(s) for s, r in enumerate(sch.stage_to_rank) if r == pp_rank})
    return Placement(sch.num_stages // sch.num_pipelines, mine, rank_of, sch.num_pipelines, n_microbatches)


def layer_bounds(num_layers: int, num_stages: int, split: Optional[Sequence[int]]) -> List[int]:
    """[0, first layer of stage 1, ..., num_layers]; an even division when ``split`` is None."""
    if num_stages > num_layers:
        raise ValueError(f"torchpp.parallelize: {num_stages} pipeline stages need at least {num_stages} "
                         f"layers, the model has {num_layers}")
    if split is None:
        starts = [round(k * num_layers / num_stages) for k in range(1, num_stages)]
    else:
        starts = list(split)
        if len(starts) != num_stages - 1:
            raise ValueError(f"torchpp.parallelize: split={starts} gives {len(starts) + 1} stages, "
                             f"the schedule has {num_stages}")
    bounds = [0] + starts + [num_layers]
    if any(a >= b for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"torchpp.parallelize: split={starts} must be increasing layer indices in "
                         f"(0, {num_layers}) so every stage gets a layer")
    return bounds


def _auto_split(model: nn.Module, layout: PipelineLayout, num_stages: int, pp: int, rank_of):
    """(split, the profiled per-stage costs) from torchpp.models.auto_split."""
    if any(param.is_meta for param in model.parameters()):
        raise ValueError("torchpp.parallelize: split='auto' times the model's layers, which a meta-device model "
                         "cannot run; give split=[...] or build the model with weights")
    from torchpp.models.auto_split import auto_split

    return auto_split(model, num_stages, pp, rank_of, layout)


def tied_across_layers(model: nn.Module, layout: PipelineLayout, bounds: Sequence[int], rank_of: Dict[int, int],
                       pp: int) -> List[nn.Parameter]:
    """Parameters that a layer and a module on another pipeline rank hold: another layer (Zamba's
    one attention block shared by its hybrid layers), or a module before or after the stack (a
    norm tied to a layer's). Read before the cut: every rank lists the same. Their gradients are
    summed over the pipeline, so every pipeline rank must hold one of their holders.

    Raises:
        PlanError: naming a parameter some pipeline rank's modules lack.
    """
    from bisect import bisect_right

    from torchpp.tensor_parallel.styles import PlanError

    stack, last = layout.layers, rank_of[len(bounds) - 2]

    def holder_rank(name: str) -> Optional[int]:
        if name.startswith(f"{stack}."):
            return rank_of[bisect_right(bounds, int(name[len(stack) + 1:].split(".", 1)[0])) - 1]
        ends = [(layout.before, rank_of[0]), (layout.after, last)]
        return next((rank for paths, rank in ends if any(name.startswith(f"{p}.") for p in paths)), None)

    ranks: Dict[int, set] = {}
    found: Dict[int, Tuple[nn.Parameter, str]] = {}
    in_stack: Dict[int, None] = {}  # ordered as named_parameters: every rank sums them in one order
    for name, param in model.named_parameters(remove_duplicate=False):
        rank = holder_rank(name)
        if rank is not None:
            ranks.setdefault(id(param), set()).add(rank)
        if name.startswith(f"{stack}."):
            in_stack.setdefault(id(param))
            found.setdefault(id(param), (param, name))
    # (a parameter only end modules hold, a tied embedding and head, is resolve.tied_across_ends')
    across = [key for key in in_stack if len(ranks[key]) > 1]
    for key in across:
        if len(ranks[key]) != pp:
            raise PlanError(f"torchpp.parallelize: {found[key][1]} is held by modules on pipeline ranks "
                            f"{sorted(ranks[key])} but not on every pipeline rank: its gradient cannot be summed; "
                            f"choose split= so that every stage holds one of its holders, or pass pp=1")
    return [found[key][0] for key in across]
