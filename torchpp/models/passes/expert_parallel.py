"""Expert parallelism: each rank of the ep group holds E/ep whole experts of every MoE layer
(the plan resolved by ``apply_plans``), tokens reaching them by all-to-all
(torchpp.expert_parallel); and, for a transformers model over several data-parallel ranks, the
router logits the load-balancing loss reads gathered over them."""
from __future__ import annotations

from torch import nn

from torchpp.models.parallel_config import ExpertOptions
from torchpp.models.passes.state import WrapState


def apply_ep(model: nn.Module, state: WrapState, options: ExpertOptions) -> nn.Module:
    """Shards the experts by ``state.ep_plan`` (if any; sets ``state.ep_context``) and gathers
    router logits over dp x cp at pp=1 (under a pipeline the loss sums the carried statistics).

    Args:
        model: the model, changed in place.
        state: reads parallel, hf, ep_plan; fills ep_context.
        options: capacity_factor.
    """
    ps = state.parallel
    if state.ep_plan is not None:
        from torchpp.expert_parallel import EPContext, apply_ep_plan

        state.ep_context = EPContext(ps.ep_group, capacity_factor=options.capacity_factor)
        apply_ep_plan(model, state.ep_plan, state.ep_context)
    if state.hf and ps.dp * ps.cp > 1 and ps.pp == 1:
        from torchpp.expert_parallel import gather_router_logits

        gather_router_logits(model, ps.dp_cp_group or ps.dp_group)
    return model
