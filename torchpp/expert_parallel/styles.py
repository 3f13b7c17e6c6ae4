"""Expert-parallel styles: the two names transformers' ``base_model_ep_plan`` uses.

| style               | on                          | what it does                                            |
|---------------------|-----------------------------|---------------------------------------------------------|
| grouped_gemm        | a fused expert tensor [E,..]| keeps this rank's E/ep experts (rows r E/ep ... )       |
| ep_dispatch_experts | the experts module          | dispatch (all-to-all), its own forward on local experts, |
|                     |                             | combine weighted by the router's probabilities          |

The experts module keeps its own forward: on the rows that arrive, it runs with ``num_experts``
= E/ep, each row's local expert as its index and a weight of one (exact), so transformers'
expert implementations (eager, grouped_mm, ...) compute the experts as before.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional

import torch
import torch.distributed as dist
from torch import nn

from torchpp import ops
from torchpp.tensor_parallel.sharding import GroupContext, PlanError


@dataclass
class EPContext(GroupContext):
    """What the expert-parallel styles applied to one model share."""

    group: dist.ProcessGroup
    capacity_factor: Optional[float] = None
    # Pairs dropped over capacity by each experts module in its last forward (name -> count).
    dropped: Dict[str, int] = field(default_factory=dict)


def is_expert_parameter(param: torch.Tensor) -> bool:
    """Whether ``param`` holds this rank's experts only (its gradients reduce over expert_dp_group)."""
    return getattr(param, "expert_parallel", None) is not None


def expert_parameters(module: nn.Module) -> List[nn.Parameter]:
    return [p for p in module.parameters() if is_expert_parameter(p)]


def shard_experts(module: nn.Module, param_name: str, name: str, ctx: EPContext) -> None:
    """``grouped_gemm``: keeps experts [r E/ep, (r+1) E/ep) of a fused [E, ...] tensor, in place
    (the same Parameter object); records (group, rank, size) as ``param.expert_parallel``."""
    param = getattr(module, param_name)
    if is_expert_parameter(param):
        return
    experts = param.size(0)
    if experts % ctx.size:
        raise PlanError(f"torchpp plan: {name} holds {experts} experts, which ep={ctx.size} does not divide (each "
                        f"rank holds whole experts)")
    local = experts // ctx.size
    with torch.no_grad():
        shard = param.detach()[ctx.rank * local:(ctx.rank + 1) * local]
        param.data = shard.clone() if param.is_meta else shard.contiguous().clone()
    param.expert_parallel = (ctx.group, ctx.rank, ctx.size)


class ExpertParallelExperts:
    """``ep_dispatch_experts``: the experts module's forward(hidden_states [T, h], top_k_index
    [T, k], top_k_weights [T, k]) becomes route -> dispatch -> its own forward on this rank's
    experts -> combine."""

    name = "ep_dispatch_experts"

    def apply(self, module: nn.Module, name: str, ctx: EPContext) -> None:
        experts = getattr(module, "num_experts", None)
        if not isinstance(experts, int):
            raise PlanError(f"torchpp plan: {name} ({type(module).__name__}) has no num_experts; style "
                            f"'ep_dispatch_experts' runs transformers' experts modules")
        if experts % ctx.size:
            raise PlanError(f"torchpp plan: {name} has num_experts={experts}, which ep={ctx.size} does not divide")
        local = experts // ctx.size
        own_forward = type(module).forward  # transformers' (its experts implementation picks the kernel)
        module.num_experts = local
        module.global_num_experts = experts

        def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
            routing = ops.moe_route(top_k_index, experts, ctx.group, capacity_factor=ctx.capacity_factor)
            if ctx.capacity_factor is not None:
                ctx.dropped[name] = int(routing.dropped)
            rows = ops.moe_dispatch(hidden_states, routing)
            counts = routing.tokens_per_local_expert.to(rows.device)
            local_index = torch.repeat_interleave(torch.arange(local, device=rows.device), counts).unsqueeze(1)
            ones = torch.ones(rows.size(0), 1, dtype=top_k_weights.dtype, device=rows.device)
            expert_rows = own_forward(module, rows, local_index, ones)
            if rows.requires_grad and not expert_rows.requires_grad:
                # A rank that received no rows (its experts' output is a fresh empty tensor) must
                # still reach moe_dispatch's backward: its peers' gradients travel by all-to-all.
                expert_rows = expert_rows + rows.sum() * 0
            return ops.moe_combine(expert_rows, top_k_weights, routing)

        # (eager under torch.compile: every size from the routing on depends on the data)
        module.forward = torch.compiler.disable(forward)


EP_STYLES = {"ep_dispatch_experts": ExpertParallelExperts()}
PARAMETER_STYLES = ("grouped_gemm",)


def apply_ep_plan(model: nn.Module, plan: Mapping[str, str], ctx: EPContext) -> Dict[str, str]:
    """Distributes the experts of ``model`` over ``ctx.group`` by ``plan`` (glob -> style, as
    transformers' ``base_model_ep_plan``); returns the resolved plan."""
    from torchpp.tensor_parallel.plan import resolve_plan

    resolved = resolve_plan(model, plan, strict=False)
    modules = dict(model.named_modules())
    for name, style in resolved.items():
        if style not in EP_STYLES and style not in PARAMETER_STYLES:
            raise PlanError(f"torchpp plan: unknown expert-parallel style {style!r} for {name}; known: "
                            f"{sorted(EP_STYLES) + list(PARAMETER_STYLES)}")
    for name, style in resolved.items():
        if style in PARAMETER_STYLES:
            owner, _, param_name = name.rpartition(".")
            shard_experts(modules[owner], param_name, name, ctx)
    for name, style in resolved.items():
        if style in EP_STYLES:
            EP_STYLES[style].apply(modules[name], name, ctx)
    return resolved
