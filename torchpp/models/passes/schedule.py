"""Schedule building (pp > 1): this rank's stages become ``PipelineStage``s under the schedule,
the stages carry what the loss needs (router statistics), and parameters held by the two end
stages (a tied embedding and head) get their group."""
from __future__ import annotations

import itertools
from typing import Dict, List, Optional

import torch.distributed as dist
from torch import nn

from torchpp.models.parallel_config import PipelineOptions
from torchpp.models.passes.state import WrapState
from torchpp.models.plans import text_config
from torchpp.models.stages import ModelStage, get_submodule
from torchpp.parallel.groups import ParallelState, mesh_grid, new_layout_group
from torchpp.parallel.object_collectives import all_gather_objects


def apply_schedule(model: nn.Module, state: WrapState, options: PipelineOptions) -> nn.Module:
    """Builds ``model.schedule`` over this rank's stages (pp > 1).

    Args:
        model: the parallelized model (``ParallelCausalLM`` or ``ParallelModule``).
        state: reads parallel, causal_lm, placement, stages, tied, tp_context, overlap.
        options: schedule and split_bw.
    """
    ps, where = state.parallel, state.placement
    if ps.pp == 1:
        return model
    if state.causal_lm and getattr(text_config(model), "output_router_logits", False):
        _carry_router_load(model, state.stages)
    _group_end_stages(model, state)
    from torchpp.pipeline import PipelineStage, build_schedule

    mine, stages = where.mine, state.stages
    pipeline_stages = [PipelineStage(stages[i], i, where.num_stages, ps.device, group=ps.pp_group,
                                     tp_group=ps.tp_group, split_bw=options.split_bw) for i in mine]
    # A plain list, not a submodule: the stages' parameters are the model's, under their own names.
    object.__setattr__(model, "pipeline_stages", [stages[i] for i in mine])
    if state.causal_lm:
        head = model.get_output_embeddings() if where.num_stages - 1 in mine else None  # elsewhere: a placeholder
        if getattr(head, "tp", None) is not None:
            head.tp.gather_output = False  # the last stage's loss works on vocabulary slices
        loss = model._microbatch_loss
    else:
        loss = model.loss_fn
    overlap_forward_backward, overlap_groups = state.overlap
    # Sequence-parallel hidden states differ per TP rank, so the pipeline must not split/gather them.
    model.schedule = build_schedule(options.schedule, pipeline_stages, where.n_microbatches, loss_fn=loss,
                                    costs=state.stage_costs, scatter_gather=not state.tp_context.sequence_parallel,
                                    grad_scaler=model.grad_scaler, overlap_forward_backward=overlap_forward_backward,
                                    overlap_groups=overlap_groups)
    return model


def _group_end_stages(model: nn.Module, state: WrapState) -> None:
    """Groups for what several pipeline ranks hold: the modules every stage runs (their
    gradients summed over the pipeline), a tied embedding and head on the first and last stages
    (summed over those two ranks), and under DualPipe the loss (each end rank computes its
    pipeline's half)."""
    ps, where, tied = state.parallel, state.placement, state.tied
    first, last = where.rank_of[0], where.rank_of[where.num_stages - 1]
    stage_shared = []
    summed = state.tied_layers + _held_by_ancestors(model, state.layout.layers)
    shared = _unique([p for path in state.layout.shared for p in get_submodule(model, path).parameters()
                      if p.requires_grad] + [p for p in summed if p.requires_grad])
    # (a frozen table, sinusoidal positions, gets no gradient to sum; tied_layers: a block layers share)
    if shared:
        stage_shared.append((shared, ps.pp_group))
        if ps.pp_rank != first:  # the gradient norm counts them on the first stage's rank
            for param in shared:
                param.shared_duplicate = True
    if first != last and where.num_pipelines == 1:
        # The same list on every rank (read before the cut); the end ranks hold each of them.
        held = {id(q) for q in model.parameters()}
        embedding_tied = [p for p in state.tied_across if id(p) in held]
        if state.tied_across or tied:
            group = end_ranks_group(ps, first, last)  # collective: every rank creates it
        if embedding_tied:
            model.embedding_group = group
            object.__setattr__(model, "_tied_copy", embedding_tied[0])  # not registered: a second name
            stage_shared.append((embedding_tied, model.embedding_group))
            if where.num_stages - 1 in where.mine:  # after finish_grads both copies hold the same gradient
                for param in embedding_tied:
                    param.shared_duplicate = True
    if where.num_pipelines == 2:
        model.loss_group = end_ranks_group(ps, first, last)
    for params, group in stage_shared:
        _check_same_shapes(model, params, group)
    model._stage_shared = stage_shared


def _check_same_shapes(model: nn.Module, params: List[nn.Parameter], group) -> None:
    """Every rank of ``group`` sums the same parameters' gradients (names and shapes compared once,
    here): a mismatch would kill a rank inside the collective (a gloo reset on the others)."""
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    mine = [(names.get(id(p), "?"), tuple(p.shape)) for p in params]
    every = all_gather_objects(mine, group)
    if any([shape for _, shape in other] != [shape for _, shape in mine] for other in every):
        ranks = dist.get_process_group_ranks(group)
        raise RuntimeError("torchpp.parallelize: the pipeline ranks disagree on the parameters whose gradients they "
                           "sum: " + "; ".join(f"rank {r}: {listed}" for r, listed in zip(ranks, every)))


def _held_by_ancestors(model: nn.Module, stack: str) -> List[nn.Parameter]:
    """Parameters the stack's ancestors hold themselves (Zaya's input scale, ``model.input_hidden_states_scale``):
    no placeholder replaces them, so every pipeline rank keeps them and only the stage using them
    gets a gradient: summed over the pipeline."""
    params, path = [], stack
    while path:
        path = path.rpartition(".")[0]
        params += list(get_submodule(model, path).parameters(recurse=False))
    return params


def _unique(params) -> List[nn.Parameter]:
    seen = {}
    for param in params:
        seen.setdefault(id(param), param)
    return list(seen.values())


def end_ranks_group(state: ParallelState, first_rank: int, last_rank: int) -> Optional[dist.ProcessGroup]:
    """The group of two pipeline ranks (the first and last stages') with this rank's (dp, cp, tp)
    coordinates; collective: every rank creates every such group."""
    grid = mesh_grid(state.tp, state.pp, state.dp, state.cp, state.order)
    mine = None
    for d, c, t in itertools.product(range(state.dp), range(state.cp), range(state.tp)):
        ranks = [int(grid[first_rank, d, c, t]), int(grid[last_rank, d, c, t])]  # every rank creates every group
        group = new_layout_group(state, ranks)
        if dist.get_rank() in ranks:
            mine = group
    return mine


def _carry_router_load(model: nn.Module, stages: Dict[int, ModelStage]) -> None:
    """The stages carry the router statistics of the load-balancing loss, which the last stage's
    loss adds per microbatch (torchpp.expert_parallel.router_load)."""
    from torchpp.expert_parallel.router_load import aux_loss_shape, record_router_load

    shape = aux_loss_shape(model)
    if shape is None:  # a causal LM without transformers' aux loss (DeepSeek-V3's) adds none at pp=1 either
        return
    record_router_load(model)
    for stage in stages.values():
        stage.router_load = shape
    model.carries_router_load = True
