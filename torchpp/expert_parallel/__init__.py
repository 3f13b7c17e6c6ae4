"""Expert parallelism: each rank of ``state.ep_group`` holds whole experts (E/ep of them), routed
tokens travel to their experts' ranks by all-to-all and back (``torchpp.ops.moe_dispatch`` /
``moe_combine``), the router stays replicated. ``parallelize(model, ep=...)`` applies it to
transformers' MoE families through their ``base_model_ep_plan``; see docs/expert_parallel.md.
"""
from torchpp.expert_parallel.styles import (
    EP_STYLES,
    EPContext,
    ExpertParallelExperts,
    apply_ep_plan,
    expert_parameters,
    is_expert_parameter,
)
from torchpp.expert_parallel.aux_loss import gather_router_logits

__all__ = [
    "EP_STYLES",
    "EPContext",
    "ExpertParallelExperts",
    "apply_ep_plan",
    "expert_parameters",
    "gather_router_logits",
    "is_expert_parameter",
]
