"""The plans ``parallelize`` follows: a transformers model's own, a user's, or (for the one
family without a plan, GPT-2) torchpp's.

A plan has a tensor-parallel part (glob -> style, ``torchpp.tensor_parallel.styles``) and a
pipeline part: the stack of layers the pipeline cuts. transformers' configs carry both
(``base_model_tp_plan``, ``base_model_pp_plan``); the model class adds its head (``lm_head``).
A user's plan is either the TP part alone, or ``{"tp": {...}, "pp": {...}}`` where the pipeline
part is transformers' form (module name -> (inputs, outputs), the stack among them) or a list
of module names in the order they run.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Mapping, Optional, Tuple

from torch import nn

from torchpp.models.mamba_plans import mamba2_plan, mamba_plan
from torchpp.models.stages import PipelineLayout, get_submodule
from torchpp.tensor_parallel.styles import PlanError, TPContext


def is_transformers_model(model: nn.Module) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return isinstance(model, PreTrainedModel)


def _gpt2_fixups(model: nn.Module, ctx: TPContext) -> None:
    """GPT-2 splits its fused c_attn output with ``split_size`` = the full width: make it this
    rank's width (its q, k and v slices; the packed style gives rank r [q_r; k_r; v_r])."""
    for block in model.transformer.h:
        attn = getattr(block, "attn", None)
        if attn is not None and hasattr(attn, "split_size"):
            attn.split_size = attn.embed_dim // ctx.size


# Families whose config has no plan: theirs, and what their modules need beyond it (one line each).
FAMILY_PLANS: Dict[str, Tuple[Dict[str, str], Optional[Callable[[nn.Module, TPContext], None]]]] = {
    "gpt2": ({
        "transformer.wte": "embedding_rowwise",
        "transformer.h.*.attn.c_attn": "packed3_colwise",  # Conv1D [h, 3h]: q, k, v blocks
        "transformer.h.*.attn.c_proj": "rowwise",
        "transformer.h.*.mlp.c_fc": "colwise",
        "transformer.h.*.mlp.c_proj": "rowwise",
        "lm_head": "colwise_gather_output",
    }, _gpt2_fixups),
}
# Families whose plan depends on the model's sizes (and the TP size): a builder (model, tp) -> (plan, fixups).
FAMILY_PLAN_BUILDERS = {"mamba": mamba_plan, "falcon_mamba": mamba_plan, "mamba2": mamba2_plan}
# Their stacks of layers (their configs carry no pipeline plan either).
FAMILY_STACKS = {"gpt2": "transformer.h", "mamba": "backbone.layers", "falcon_mamba": "backbone.layers",
                 "mamba2": "backbone.layers"}


# Entries some transformers plans miss or get wrong: parameters applied to rank-local activations
# (between a column- and a row-split projection), whose gradients are partial on each rank;
# per-head quantities of an attention whose heads are split.
AMENDMENTS: Dict[str, Dict[str, str]] = {
    "apertus": {"model.layers.*.mlp.act_fn": "replicated_with_grad_allreduce"},  # xIELU's learned alphas
    "apertus1p5_text": {"model.layers.*.mlp.act_fn": "replicated_with_grad_allreduce"},
    # Doge's per-head dynamic mask: dt_proj reads every head's values and gives one value per key/value
    # head, of which each rank keeps its own heads' (and the per-head A), not the whole (its plan: rowwise).
    "doge": {"model.layers.*.self_attn.dt_proj": "rowwise_scatter_output", "model.layers.*.self_attn.A": "colwise"},
    # GPT-OSS: transformers' plan splits its embedding alone (5.24). Heads with their attention sinks;
    # every expert's features, gate and up alternating (pair by pair), the down bias added once over TP.
    "gpt_oss": {"model.layers.*.self_attn.q_proj": "colwise", "model.layers.*.self_attn.k_proj": "colwise",
                "model.layers.*.self_attn.v_proj": "colwise", "model.layers.*.self_attn.o_proj": "rowwise",
                "model.layers.*.self_attn.sinks": "colwise", "model.layers.*.mlp.experts": "moe_tp_experts",
                "model.layers.*.mlp.experts.gate_up_proj": "rowwise",
                "model.layers.*.mlp.experts.gate_up_proj_bias": "colwise",
                "model.layers.*.mlp.experts.down_proj": "colwise",
                "model.layers.*.mlp.experts.down_proj_bias": "partial_sum_bias"},
}
HEAD_NORMS = ("q_norm", "k_norm")  # Qwen3-style norms over each projected query / key head


def complete_hf_plan(model: nn.Module, plan: Dict[str, str]) -> Dict[str, str]:
    """transformers' plan plus what it misses: the per-head q/k norms of attention whose q/k
    projections it splits by heads (several types' plans leave them out), fused ``gate_up_proj``
    weights split half by half where a plan says plain ``colwise``, and ``AMENDMENTS``.
    (Norms over a projection's whole width: ``torchpp.models.split_checks``.)"""
    plan = dict(plan)
    for key, style in list(plan.items()):
        parent, _, name = key.rpartition(".")
        if style == "colwise" and name == "gate_up_proj":  # fused [gate; up], chunked in two: split each half
            plan[key] = "packed_colwise"
        if style == "colwise" and name in ("q_proj", "k_proj"):
            for norm in HEAD_NORMS:
                plan.setdefault(f"{parent}.{norm}", "replicated_with_grad_allreduce")
    plan.update(AMENDMENTS.get(_model_type(model), {}))
    return plan


def _model_type(model: nn.Module) -> Optional[str]:
    return getattr(getattr(model, "config", None), "model_type", None)


def text_config(model: nn.Module):
    """The config of a model's text part (a multimodal config's text sub-config), or None."""
    config = getattr(model, "config", None)
    return config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config


def family_plan(model: nn.Module, tp: int) -> Optional[Tuple[Dict[str, str], Optional[Callable]]]:
    """torchpp's own TP plan for a family whose config carries none (``FAMILY_PLANS``,
    ``FAMILY_PLAN_BUILDERS``), and its fixups; None for any other."""
    builder = FAMILY_PLAN_BUILDERS.get(_model_type(model))
    if builder is not None:
        return builder(model, tp)
    family = FAMILY_PLANS.get(_model_type(model))
    return None if family is None else (dict(family[0]), family[1])


def hf_tp_plan(model: nn.Module, tp: int = 1) -> Tuple[Dict[str, str], Optional[Callable]]:
    """A transformers model's TP plan (full module names), and the fixups its family needs."""
    family = family_plan(model, tp)
    if family is not None:
        return family
    plan = dict(getattr(model, "tp_plan", None) or {})
    if not plan:
        config = model.config
        base = getattr(config, "base_model_tp_plan", None) or {}
        prefix = getattr(model, "base_model_prefix", "")
        plan = {(f"{prefix}.{k}" if prefix and hasattr(model, prefix) else k): v for k, v in base.items()}
        plan.update(getattr(type(model), "_tp_plan", None) or {})
    if not plan:
        raise PlanError(f"torchpp.parallelize: {type(model).__name__} (model type {_model_type(model)!r}) has no "
                        f"tensor-parallel plan (its config's base_model_tp_plan is empty); pass plan=")
    return complete_hf_plan(model, plan), None


def _stack_path(model: nn.Module, names: List[str]) -> Optional[str]:
    for name in names:
        try:
            module = get_submodule(model, name)
        except AttributeError:
            continue
        if isinstance(module, nn.ModuleList):
            return name
    return None


def _param_holding_children(module: nn.Module) -> List[Tuple[str, nn.Module]]:
    return [(name, child) for name, child in module.named_children() if any(True for _ in child.parameters())]


def layout_around(model: nn.Module, stack: str) -> PipelineLayout:
    """The pipeline layout around the stack at ``stack``: the modules holding parameters that are
    registered before it in its parent (and in the parent's ancestors) run on the first stage,
    those after it on the last (transformers registers modules in the order its forward runs
    them). Modules without parameters (rotary tables, dropout) stay on every stage."""
    levels_before: List[List[str]] = []
    after: List[str] = []
    path = stack
    while path:
        parent_path, _, name = path.rpartition(".")
        level: List[str] = []
        seen = False
        for child_name, _ in _param_holding_children(get_submodule(model, parent_path)):
            full = f"{parent_path}.{child_name}" if parent_path else child_name
            if child_name == name:
                seen = True
            else:
                (after if seen else level).append(full)
        levels_before.insert(0, level)
        path = parent_path
    return PipelineLayout(stack, [p for level in levels_before for p in level], after)


def hf_layout(model: nn.Module) -> Optional[PipelineLayout]:
    """Where a transformers model is cut: its base_model_pp_plan's stack of layers."""
    pp_plan = dict(getattr(model, "pp_plan", None) or {})
    names = list(pp_plan)
    if not names:
        base = getattr(model.config, "base_model_pp_plan", None) or {}
        prefix = getattr(model, "base_model_prefix", "")
        names = [f"{prefix}.{k}" if prefix and hasattr(model, prefix) else k for k in base]
    if _model_type(model) in FAMILY_STACKS:
        names = [FAMILY_STACKS[_model_type(model)]]
    stack = _stack_path(model, names)
    return None if stack is None else layout_around(model, stack)


def user_plans(model: nn.Module, plan: Mapping) -> Tuple[Dict[str, str], Optional[PipelineLayout]]:
    """A user's plan: the TP globs alone, or {"tp": ..., "pp": ...}."""
    if not isinstance(plan, Mapping):
        raise PlanError(f"torchpp.parallelize: plan must be a dict of module-name globs to style names (or "
                        f"{{'tp': ..., 'pp': ...}}), got {type(plan).__name__}")
    if set(plan) <= {"tp", "pp"} and plan:
        tp_plan, pp_plan = dict(plan.get("tp") or {}), plan.get("pp")
    else:
        tp_plan, pp_plan = dict(plan), None
    if pp_plan is None:
        return tp_plan, None
    names = list(pp_plan)
    stack = _stack_path(model, names)
    if stack is None:
        raise PlanError(f"torchpp.parallelize: the plan's pp entry {names} names no nn.ModuleList of layers to cut "
                        f"into stages")
    position = names.index(stack)
    for name in names:
        get_submodule(model, name)  # a clear AttributeError naming a missing module
    return tp_plan, PipelineLayout(stack, names[:position], names[position + 1:])
