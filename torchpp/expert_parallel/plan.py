"""The expert-parallel plan a model follows: transformers' ``base_model_ep_plan`` (module and
parameter globs -> ``ep_dispatch_experts`` / ``grouped_gemm``)."""
from __future__ import annotations

from typing import Dict, Mapping, Optional, Tuple

from torch import nn

from torchpp.tensor_parallel.plan import glob_pattern, resolve_plan
from torchpp.tensor_parallel.styles import PlanError


def hf_ep_plan(model: nn.Module) -> Dict[str, str]:
    """Full-name globs of a transformers model's expert-parallel plan."""
    config = getattr(model, "config", None)
    config = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
    base = getattr(config, "base_model_ep_plan", None) or {}
    if not base:
        raise PlanError(f"torchpp.parallelize: ep > 1 needs an expert-parallel plan: {type(model).__name__} has no "
                        f"base_model_ep_plan (its config's base_model_ep_plan is empty)")
    prefix = getattr(model, "base_model_prefix", "")
    return {(f"{prefix}.{k}" if prefix and hasattr(model, prefix) else k): v for k, v in base.items()}


def without_expert_entries(tp_plan: Mapping[str, str], ep_plan: Mapping[str, str]) -> Dict[str, str]:
    """The TP plan less its entries for what the EP plan distributes (whole experts per rank)."""
    patterns = [glob_pattern(glob) for glob in ep_plan]
    # A TP glob naming the same modules as an EP glob (the same glob text, modulo the prefix).
    return {glob: style for glob, style in tp_plan.items()
            if not any(p.match(glob.replace("*", "0")) for p in patterns)}


def expert_plans(model: nn.Module, state, tp_plan: Mapping[str, str], expert_tensor_parallel: bool,
                 capacity_factor: Optional[float]) -> Tuple[Dict[str, str], Dict[str, str]]:
    """(the EP plan, the TP plan to apply with it) for ``parallelize(model, ep=state.ep)``;
    raises, naming the values, for what expert parallelism cannot do here."""
    if state.ep == 1:
        raise ValueError(f"torchpp.parallelize: capacity_factor={capacity_factor} applies to expert parallelism; "
                         f"the parallel state has ep=1")
    ep_plan = hf_ep_plan(model)
    if not any(style == "ep_dispatch_experts" for style in resolve_plan(model, ep_plan, False).values()):
        raise PlanError(f"torchpp.parallelize: ep={state.ep}, but the expert-parallel plan {ep_plan} matches no "
                        f"experts module of {type(model).__name__}")
    return ep_plan, dict(tp_plan) if expert_tensor_parallel else without_expert_entries(tp_plan, ep_plan)
