"""Plan resolution, the first pass of ``parallelize``: which plans the model follows and where
its stages live, and every refusal that can be made before the model changes.

``apply_plans`` reads the whole config: a bad combination of features (a context-parallel
model that is no causal LM, a head count TP cannot divide) raises here, with the model untouched.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Dict, List, Mapping, Optional, Tuple

import torch
from torch import nn

from torchpp import tensor_parallel as tp
from torchpp.models.parallel_config import ParallelConfig
from torchpp.models.passes.state import WrapState
from torchpp.models.stages import get_submodule
from torchpp.models.plans import (family_plan, hf_layout, hf_tp_plan, is_transformers_model, layout_around, text_config,
                                  user_plans)
from torchpp.parallel.groups import ParallelState, get_parallel_state, init_parallel
from torchpp.tensor_parallel.plan import resolve_plan
from torchpp.tensor_parallel.random import TP_RNG_STATE, TP_SEED_OFFSET
from torchpp.tensor_parallel.styles import PlanError, TPContext

LOG = logging.getLogger("torchpp")

ATTENTION_WORDS = ("attn", "attention")


def resolve_parallel_state(state: Optional[ParallelState], config: ParallelConfig) -> ParallelState:
    """The given state (its sizes checked against the config's), else the current one, else a new one."""
    asked = {"tp": config.tp, "pp": config.pp, "cp": config.cp, "ep": config.ep}
    if state is None:
        try:
            state = get_parallel_state()
        except RuntimeError:
            state = init_parallel(**{name: size or 1 for name, size in asked.items()})
    if any(size is not None and size != getattr(state, name) for name, size in asked.items()):
        given = ", ".join(f"{name}={size}" for name, size in asked.items() if size is not None)
        held = ", ".join(f"{name}={getattr(state, name)}" for name in asked)
        raise ValueError(f"torchpp.parallelize: {given} disagree with the parallel state ({held}); pass state= "
                         f"or matching sizes")
    # Dropout on head-split activations needs the per-TP-rank stream; seed it if the user has not.
    tracker = tp.get_rng_tracker()
    if TP_RNG_STATE not in tracker.get_states():
        tracker.add(TP_RNG_STATE, torch.initial_seed() % 2**31 + TP_SEED_OFFSET + state.tp_rank)
    return state


def apply_plans(model: nn.Module, state: WrapState, config: ParallelConfig) -> nn.Module:
    """Records the model's plans (TP, EP, the pipeline layout) and TP context in ``state``;
    raises on anything the later passes would refuse, before any of them changes the model.

    Args:
        model: the unwrapped model (not changed).
        state: filled in: hf, causal_lm, tp_plan, strict, layout, fixups, ep_plan, tp_context,
            overlap, tied_names.
        config: the whole configuration (checked against the model).
    """
    from torchpp.expert_parallel.overlap import forward_backward_overlap

    ps = state.parallel
    state.overlap = forward_backward_overlap(ps, config.pipeline.schedule, config.pipeline.overlap_forward_backward,
                                             config.zero)
    _resolve_plans(model, state, config.plan)
    _check_features(model, state, config)
    if state.hf and ps.pp > 1:  # registration order is a guess: one traced forward tells what runs where
        from torchpp.models.run_order import traced_layout

        state.layout = traced_layout(model, state.layout)
    if state.hf and state.causal_lm and (ps.pp > 1 or ps.cp > 1):  # torchpp computes the loss: the model's convention
        from torchpp.models.parallel_causal_lm import model_shifts_labels

        state.loss_shifts_labels = model_shifts_labels(model)
    if ps.cp > 1 and state.hf:  # on the whole model: every pipeline rank refuses alike, before the cut
        from torchpp.context_parallel.hf_support import check_model

        state.cp_positions = check_model(model, ps.cp, state.layout.layers if state.layout is not None else None)
        if config.context.mode in ("all-to-all", "all-to-all+ring"):
            from torchpp.context_parallel.hf_support import check_all_to_all_heads
            from torchpp.context_parallel.hierarchical import check_all_to_all_size

            hierarchical = config.context.mode == "all-to-all+ring"
            if hierarchical:
                check_all_to_all_size(config.context.all_to_all_size, ps.cp)
            check_all_to_all_heads(model, ps.tp, config.context.all_to_all_size if hierarchical else ps.cp,
                                   config.context.mode)
    state.tp_context = tp_context(model, ps, config.tensor.sequence_parallel, split_bw=ps.pp > 1)
    if ps.ep > 1 or config.experts.capacity_factor is not None:  # bad ep plans raise before anything changes
        from torchpp.expert_parallel.plan import expert_plans

        state.ep_plan, state.tp_plan = expert_plans(model, ps, state.tp_plan, config.experts.tensor_parallel,
                                                    config.experts.capacity_factor)
    if ps.tp > 1 and not state.strict and state.hf:  # statistics across a split width: that group gathers
        from torchpp.models.split_checks import gather_where_width_statistics

        state.tp_plan = gather_where_width_statistics(model, resolve_plan(model, state.tp_plan, False))
    state.layer_contexts = layer_contexts(model, state.tp_context, state.layout and state.layout.layers)
    if ps.tp > 1:  # bad plans and head counts raise before anything changes
        check_heads(resolve_plan(model, state.tp_plan, state.strict), context_of(state.tp_context, state.layer_contexts))
    state.tied_names = tied_names(model)
    return model


def _resolve_plans(model: nn.Module, state: WrapState, plan) -> None:
    state.hf = is_transformers_model(model)
    if isinstance(plan, str):
        if plan != "auto":
            raise PlanError(f"torchpp.parallelize: plan={plan!r}: a plan is a dict of globs to styles or 'auto'")
        from torchpp.models.auto_plan import auto_plans, divide_head_attributes, find_stack
        from torchpp.models.mamba_plans import divide_mixer_counts

        ps = state.parallel
        family = family_plan(model, ps.tp) if ps.tp > 1 else None
        if family is not None:  # torchpp's plan for the family (Mamba's mixer: beyond the rule)
            state.tp_plan, state.layout = family[0], layout_around(model, find_stack(model))
            LOG.info("torchpp.parallelize(plan='auto') for %s: torchpp's plan for the %s family",
                     type(model).__name__, model.config.model_type)
        elif ps.tp > 1:  # each split the rule picks is first tried at this tp
            state.tp_plan, state.layout = auto_plans(model, ps.tp, tp_context(model, ps, False, False))
        else:  # nothing to split: only the stack to cut (a layer the TP rule cannot decide does not matter)
            state.tp_plan, state.layout = {}, layout_around(model, find_stack(model))
        if ps.pp > 1:  # a stage must be able to start at any layer of the stack
            from torchpp.models.stack_check import check_layers_chain

            check_layers_chain(model, state.layout.layers)
        state.fixups = family[1] if family is not None else (
            lambda module, ctx: divide_head_attributes(module, state.tp_plan, ctx,
                                                       done=divide_mixer_counts(module, state.tp_plan, ctx)))
    elif plan is not None:
        state.tp_plan, state.layout = user_plans(model, plan)
        state.strict = True
        if state.hf:  # transformers' attention counts every head (BLOOM's num_heads): as under "auto"
            from torchpp.models.auto_plan import divide_head_attributes

            # (attention only: unlike "auto", no trial confirms it, and a layer may keep its width too)
            attention = {name: style for name, style in state.tp_plan.items()
                         if any(word in name.rpartition(".")[0].rpartition(".")[2] for word in ATTENTION_WORDS)}
            state.fixups = lambda module, ctx: divide_head_attributes(module, attention, ctx)
            if state.layout is None:
                state.layout = hf_layout(model)
    elif state.hf:
        state.tp_plan, state.fixups = hf_tp_plan(model, state.parallel.tp)
        state.layout = hf_layout(model)
    else:
        raise PlanError(f"torchpp.parallelize: {type(model).__name__} is not a transformers model; pass plan= (a dict "
                        f"of module-name globs to styles, e.g. {{'blocks.*.fc1': 'colwise', 'blocks.*.fc2': 'rowwise'}})")
    state.causal_lm = state.hf and model.get_output_embeddings() is not None


def _check_features(model: nn.Module, state: WrapState, config: ParallelConfig) -> None:
    ps, name = state.parallel, type(model).__name__
    if getattr(text_config(model), "output_router_logits", False):
        check_aux_loss(ps, config.tensor.sequence_parallel)
    if ps.cp > 1 and not state.hf:
        raise PlanError(f"torchpp.parallelize: cp={ps.cp} shards the sequence of a transformers model; "
                        f"{name} is not one (use torchpp.context_parallel's ops in your own model)")
    if ps.cp > 1 and ps.pp > 1 and not state.causal_lm:
        raise PlanError(f"torchpp.parallelize: cp={ps.cp} with pp={ps.pp} needs a transformers causal LM, whose "
                        f"step shards the batch and its targets; {name} is a base model (at pp=1 it takes cp)")
    if config.tensor.vocab_parallel_logits and not state.causal_lm:
        raise ValueError("torchpp.parallelize: vocab_parallel_logits=True needs a transformers causal LM")
    if ps.pp > 1 and state.layout is None:
        raise PlanError(f"torchpp.parallelize: pp={ps.pp} needs a stack of layers to cut: {name} "
                        f"has no base_model_pp_plan; pass plan={{'tp': ..., 'pp': [...]}}")
    if config.tensor.sequence_parallel and ps.tp > 1 and state.layout is None:
        raise PlanError("torchpp.parallelize: sequence_parallel needs the model's stack of layers (a pp plan)")
    if config.recompute == "full" and state.layout is None:
        raise PlanError("torchpp.parallelize: recompute='full' checkpoints each layer of the stack (a pp plan)")
    if config.recompute == "selective" and not state.hf:
        raise PlanError("torchpp.parallelize: recompute='selective' recomputes a transformers model's attention "
                        "function; for another model use recompute='full'")


def check_aux_loss(state: ParallelState, sequence_parallel: bool) -> None:
    """The MoE load-balancing loss (output_router_logits=True) where torchpp can keep it exact."""
    if state.pp > 1 and sequence_parallel and state.tp > 1:  # each router would count its sequence slice alone
        raise NotImplementedError(f"torchpp.parallelize: the MoE load-balancing loss (output_router_logits=True) under "
                                  f"a pipeline (pp={state.pp}) is not supported with sequence_parallel=True and "
                                  f"tp={state.tp}")
    if state.cp > 1:  # transformers adds it to each cp rank's loss, which the cp sum would count c times
        raise NotImplementedError(f"torchpp.parallelize: the MoE load-balancing loss (output_router_logits=True) "
                                  f"is not supported with cp={state.cp}")


def tp_context(model: nn.Module, state: ParallelState, sequence_parallel: bool, split_bw: bool) -> TPContext:
    """The TP styles' context: the group and the model-wide head counts (a heterogeneous
    config's global values; ``layer_contexts`` has each layer's)."""
    return _with_heads(TPContext(state.tp_group, sequence_parallel=sequence_parallel, split_bw=split_bw),
                       text_config(model))


def _with_heads(ctx: TPContext, config) -> TPContext:
    heads = config_value(config, "num_attention_heads")
    kv_heads = config_value(config, "num_key_value_heads") or heads
    head_dim = config_value(config, "head_dim")
    hidden = config_value(config, "hidden_size")
    if head_dim is None and isinstance(heads, int) and heads and isinstance(hidden, int):
        head_dim = hidden // heads
    return dataclasses.replace(ctx, num_heads=heads if isinstance(heads, int) else None,
                               num_kv_heads=kv_heads if isinstance(kv_heads, int) else None,
                               head_dim=head_dim if isinstance(head_dim, int) else None)


def config_value(config, key: str):
    """``config.key`` (None if absent); on a heterogeneous config (transformers' per-layer
    configs) the global value of a per-layer attribute, which only modules outside the layers use."""
    if config is None:
        return None
    if getattr(config, "is_heterogeneous", False) and key in (config.per_layer_attributes or ()):
        return config._getattr_without_heterogeneous_validation(key, None)
    return getattr(config, key, None)


def layer_contexts(model: nn.Module, ctx: TPContext, stack: Optional[str]) -> Dict[str, TPContext]:
    """{path of a layer: its TP context} for the layers of a heterogeneous config whose head
    counts differ from the model-wide ones (empty otherwise)."""
    config = text_config(model)
    if stack is None or not getattr(config, "is_heterogeneous", False):
        return {}
    contexts = {}
    for index in range(len(get_submodule(model, stack))):
        layer_ctx = _with_heads(ctx, config.per_layer_config[index])
        if layer_ctx != ctx:
            contexts[f"{stack}.{index}"] = layer_ctx
    return contexts


def context_of(ctx: TPContext, contexts: Mapping[str, TPContext]):
    """name -> the TP context of the layer holding it (``layer_contexts``), else ``ctx``."""
    def lookup(name: str) -> TPContext:
        parts = name.split(".")
        for end in range(len(parts), 0, -1):
            found = contexts.get(".".join(parts[:end]))
            if found is not None:
                return found
        return ctx
    return lookup


def check_heads(resolved: Mapping[str, str], context_of) -> None:
    """Head-split attention needs whole query heads per rank (key/value heads: whole or copied);
    ``context_of(name)``: the TP context of the module ``name``."""
    for name, style in resolved.items():
        if style not in ("colwise", "packed_colwise", "packed3_colwise") or not any(w in name for w in ATTENTION_WORDS):
            continue
        ctx = context_of(name)
        heads, kv, t = ctx.num_heads, ctx.num_kv_heads, ctx.size
        if heads and heads % t:
            raise PlanError(f"torchpp.parallelize: tp={t} does not divide num_attention_heads={heads} of {name} (each "
                            f"tensor-parallel rank holds whole attention heads)")
        if kv and kv % t and t % kv:
            raise PlanError(f"torchpp.parallelize: tp={t} must divide num_key_value_heads={kv} of {name} or be a "
                            f"multiple of it (each rank holds whole key/value heads, copies of them when tp exceeds "
                            f"their number)")


def tied_parameters(model: nn.Module) -> List[nn.Parameter]:
    """Parameters that more than one module holds (a tied input and output embedding)."""
    holders: Dict[int, int] = {}
    params: Dict[int, nn.Parameter] = {}
    for _, module in model.named_modules(remove_duplicate=False):
        for param in module.parameters(recurse=False):
            holders[id(param)] = holders.get(id(param), 0) + 1
            params[id(param)] = param
    return [params[k] for k, n in holders.items() if n > 1]


def tied_across_ends(model: nn.Module, before: List[str], after: List[str], shared: List[str]) -> List[nn.Parameter]:
    """Tied parameters held by a module of the first stage (``before`` the stack) and one of the last
    (``after`` it), none every stage runs (``shared``): their gradients are summed between the two
    end stages. Read before the cut, so every rank lists the same ones in the same order (a head's
    bias tied inside the head alone is not among them)."""
    holders: Dict[int, Tuple[nn.Parameter, List[str]]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        holders.setdefault(id(param), (param, []))[1].append(name)

    def under(name: str, paths: List[str]) -> bool:
        return any(name.startswith(f"{path}.") for path in paths)

    return [param for param, names in holders.values() if len(names) > 1 and not any(under(n, shared) for n in names)
            and any(under(n, before) for n in names) and any(under(n, after) for n in names)]


def tied_names(model: nn.Module) -> Dict[str, str]:
    """{second name of a tied parameter: its first name} (a tied head: its embedding's name),
    which checkpoints read and write once."""
    first: Dict[int, str] = {}
    aliases: Dict[str, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases[name] = first[id(param)]
        else:
            first[id(param)] = name
    return aliases
