"""Applying a tensor-parallel plan to an existing model, in place.

A plan is data: module- or parameter-name globs (``*`` stands for one name component, such as a
layer number) mapped to style names (``torchpp.tensor_parallel.styles.STYLES``), as in
transformers' ``base_model_tp_plan`` and torch's ``parallelize_module``::

    plan = {"blocks.*.attn.qkv": "colwise", "blocks.*.attn.proj": "rowwise",
            "blocks.*.mlp.fc1": "colwise", "blocks.*.mlp.fc2": "rowwise"}
    apply_tp_plan(model, plan, TPContext(group))

and, for sequence parallelism, ``apply_sequence_parallel`` on the model's stack of layers.
"""
from __future__ import annotations

import re
from typing import Callable, Dict, List, Mapping, Optional, Set

import torch
from torch import nn

from torchpp import ops
from torchpp.tensor_parallel.sharding import PlanError, TPContext, sum_grads_over_tp
from torchpp.tensor_parallel.styles import get_style


def glob_pattern(glob: str) -> "re.Pattern[str]":
    """A regex for a plan glob: ``*`` matches one dotted name component."""
    return re.compile("^" + r"\.".join("[^.]+" if part == "*" else re.escape(part) for part in glob.split(".")) + "$")


def resolve_plan(model: nn.Module, plan: Mapping[str, str], strict: bool) -> Dict[str, str]:
    """{module or parameter name: style name} for every name a glob of ``plan`` matches.

    Args:
        model: the model the names refer to.
        plan: glob -> style name.
        strict: a glob that matches nothing raises (a user's plan); transformers' plans name
            modules some configs lack (dense and MoE layers, shared experts), so theirs are not.
    """
    # Placeholders of modules held by other pipeline ranks take no style.
    modules = [name for name, m in model.named_modules() if name and not getattr(m, "placeholder", False)]
    params = [name for name, _ in model.named_parameters(remove_duplicate=False)]
    resolved: Dict[str, str] = {}
    for glob, style in plan.items():
        if not isinstance(style, str):
            raise PlanError(f"torchpp plan: the style of {glob!r} must be a style name, got {style!r}")
        pattern = glob_pattern(glob)
        matched = [name for name in modules + params if pattern.match(name)]
        if not matched and strict:
            raise PlanError(f"torchpp plan: {glob!r} matches no module or parameter of {type(model).__name__}")
        for name in matched:
            if name in resolved and resolved[name] != style:
                raise PlanError(f"torchpp plan: {name} gets two styles, {resolved[name]!r} and {style!r}")
            resolved[name] = style
    _check_copied_inputs(resolved)
    return resolved


def _check_copied_inputs(resolved: Mapping[str, str]) -> None:
    """A ``colwise_after_copy`` linear has no f: some module must have the one its input relies on."""
    after_copy = sorted(name for name, style in resolved.items() if style == "colwise_after_copy")
    if after_copy and "replicated_copy_output" not in resolved.values():
        raise PlanError(f"torchpp plan: {after_copy[0]} has style 'colwise_after_copy' (no f on its input), but no "
                        f"module has 'replicated_copy_output' to give its input's source one: its input's gradient "
                        f"would never be summed over TP; use 'colwise'")


def apply_tp_plan(model: nn.Module, plan: Mapping[str, str], ctx: TPContext, *, strict: bool = True,
                  config=None, context_of: Optional[Callable[[str], TPContext]] = None) -> Dict[str, str]:
    """Shards ``model`` in place by ``plan`` over ``ctx.group``; returns the resolved plan.

    Parameters named by the plan are sharded first, then modules get their styles. A module
    whose parameter a style sharded but which has no style of its own (a tied embedding left
    out of the plan) raises: it would compute with a shard as if it were the whole tensor.
    ``context_of(name)``, if given, is the context of the module or parameter ``name`` (layers
    whose head counts differ from the model's); ``ctx`` otherwise.
    """
    resolved = resolve_plan(model, plan, strict)
    modules = dict(model.named_modules())
    params = dict(model.named_parameters(remove_duplicate=False))
    where = context_of or (lambda name: ctx)
    for name, style_name in resolved.items():
        style = get_style(style_name, name, config)
        if name in params and name not in modules:
            owner_name, _, param_name = name.rpartition(".")
            style.apply_param(modules[owner_name], param_name, name, where(name))
    # Replicated modules last: one holding split linears (DiffLlama's attention, for its lambdas) sums
    # the gradients of its parameters no other style has sharded by then.
    for name, style_name in sorted(resolved.items(), key=lambda item: item[1] == "replicated_with_grad_allreduce"):
        if name in modules:
            get_style(style_name, name, config).apply(modules[name], name, where(name))
    _check_shards_have_owners(model, resolved)
    return resolved


def _check_shards_have_owners(model: nn.Module, resolved: Mapping[str, str]) -> None:
    styled = {name for name in resolved}
    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            name = f"{module_name}.{param_name}" if module_name else param_name
            sharded = getattr(param, "tensor_model_parallel", False)
            if sharded and module_name not in styled and name not in styled and not _under_styled(module_name, styled):
                raise PlanError(f"torchpp plan: {name} is sharded (it is tied to a module the plan names) but "
                                f"{module_name or type(model).__name__} has no style of its own; add it to the plan")


def _under_styled(module_name: str, styled) -> bool:
    # A parameter entry's owner (experts) or a module inside a styled one runs with local shards.
    return any(module_name == s.rpartition(".")[0] or module_name.startswith(s + ".") for s in styled)


NORM_WORDS = ("norm", "dropout", "identity")


def _runs_on_slices(module: nn.Module) -> bool:
    """Token-wise children of a layer (norms, dropout) that sequence parallelism runs on slices."""
    name = type(module).__name__.lower()
    return any(word in name for word in NORM_WORDS) or isinstance(module, (nn.LayerNorm, nn.Dropout, nn.Identity))


def _stream_args_hook(gather: Callable[[torch.Tensor], torch.Tensor], from_outside: Set[int]):
    """A forward pre-hook gathering a child's hidden states (its first argument, or the keyword
    ``hidden_states``) and every other argument shaped like them: a slice of the residual stream
    that the child adds inside itself (BLOOM's and MPT's attention and MLP take ``residual``).
    Tensors the layer itself was given besides its hidden states (``from_outside``: an encoder's
    states, say) are never slices, whatever their shape."""

    # (Plain loops: torch.compile traces them in a compiled layer; it broke on the comprehensions.)
    def hook(module, args, kwargs):
        first = args[0] if args else kwargs.get("hidden_states")
        if not isinstance(first, torch.Tensor):
            return None

        def on_stream(x):
            return x is first or isinstance(x, torch.Tensor) and x.shape == first.shape and id(x) not in from_outside

        gathered_args = []
        for a in args:
            gathered_args.append(gather(a) if on_stream(a) else a)
        gathered_kwargs = {}
        for k, v in kwargs.items():
            gathered_kwargs[k] = gather(v) if on_stream(v) else v
        return tuple(gathered_args), gathered_kwargs

    return hook


def _record_outside_inputs(from_outside: Set[int]):
    """A layer's forward pre-hook: the ids of the tensors it is given besides its hidden states."""

    def hook(module, args, kwargs):
        from_outside.clear()
        for t in args[1:]:
            if isinstance(t, torch.Tensor):
                from_outside.add(id(t))
        for k, v in kwargs.items():
            if isinstance(v, torch.Tensor) and (args or k != "hidden_states"):
                from_outside.add(id(v))

    return hook


def apply_sequence_parallel(stack: nn.ModuleList, ctx: TPContext, *, layers: Optional[List[int]] = None,
                            first: bool = True, last: bool = True, sequence_dim: int = 1) -> List[str]:
    """Megatron-3's sequence parallelism on a stack of layers, by hooks.

    The residual stream between the layers, and the norms and dropout inside them, hold this
    rank's slice of the sequence: the stack's input is split (keep own slice; gradient
    all-gathered) and its output gathered (all-gather; gradient sliced). Every other child of
    a layer (attention, MLP, experts, mixers) all-gathers its input and keeps its own slice of
    its output, so it runs as without sequence parallelism; the norms' gradients, partial per
    slice, are summed over TP.

    Args:
        stack: the model's layers.
        ctx: the TP context.
        layers: indices of the layers this rank holds (default: all).
        first, last: whether this rank holds the stack's first / last layer (a pipeline stage
            holds some of them; the split and the gather happen where the ends are).
        sequence_dim: the sequence dimension of the hidden states ([b, s, h]: 1).

    Returns:
        The names (``index.child``) of the children run on sequence slices.
    """
    from torchpp.tensor_parallel.hook_styles import _first_arg_hook, _map_first_output

    group, dim = ctx.group, sequence_dim
    scatter = lambda x: ops.scatter_to_tp_region(x, group, dim=dim)  # noqa: E731
    gather = lambda x: ops.gather_from_tp_region(x, group, dim=dim)  # noqa: E731
    layers = list(range(len(stack))) if layers is None else list(layers)
    on_slices: List[str] = []
    for index in layers:
        layer = stack[index]
        from_outside: Set[int] = set()
        ctx.hooks.append(layer.register_forward_pre_hook(_record_outside_inputs(from_outside), with_kwargs=True))
        for param in layer.parameters(recurse=False):
            sum_grads_over_tp(param, ctx)
        for child_name, child in layer.named_children():
            if _runs_on_slices(child):
                for param in child.parameters():
                    sum_grads_over_tp(param, ctx)
                on_slices.append(f"{index}.{child_name}")
            else:
                ctx.hooks.append(child.register_forward_pre_hook(_stream_args_hook(gather, from_outside), with_kwargs=True))
                ctx.hooks.append(child.register_forward_hook(_map_first_output(scatter)))
    if first:
        ctx.hooks.append(stack[0].register_forward_pre_hook(_first_arg_hook(scatter), with_kwargs=True))
    if last:
        ctx.hooks.append(stack[len(stack) - 1].register_forward_hook(_map_first_output(gather)))
    return on_slices
