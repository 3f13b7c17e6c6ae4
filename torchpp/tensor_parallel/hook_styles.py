"""Tensor-parallel styles that give a module hooks (collectives on its inputs or outputs, gradient
sums of its replicated parameters) or leave it as it is; the linear and embedding styles, which
give a module a class of its own, and the registry are in ``styles``."""
from __future__ import annotations

from typing import Callable, Optional

import torch

from torchpp import ops
from torchpp.tensor_parallel.layouts import Split
from torchpp.tensor_parallel.sharding import PlanError, shard_parameter, sum_grads_over_tp
from torchpp.tensor_parallel.style_base import Style
from torchpp.tensor_parallel.tp_forwards import LinearTP


class ReplicatedWithGradAllReduce(Style):
    name = "replicated_with_grad_allreduce"

    def apply(self, module, name, ctx):
        for param_name, param in module.named_parameters():
            layout = getattr(param, "tp_layout", None)
            if param.requires_grad and (layout is None or layout.dim is None):  # a shard's gradient is its own
                sum_grads_over_tp(param, ctx)

    def apply_param(self, module, param_name, name, ctx):
        sum_grads_over_tp(getattr(module, param_name), ctx)


def _first_arg_hook(transform: Callable[[torch.Tensor], torch.Tensor], names=("hidden_states",)):
    """A forward pre-hook applying ``transform`` to the first positional argument (or the first
    of ``names`` given by keyword)."""

    def hook(module, args, kwargs):
        if args:
            return (transform(args[0]),) + tuple(args[1:]), kwargs
        for key in names:
            if key in kwargs:
                return args, {**kwargs, key: transform(kwargs[key])}
        return None

    return hook


def _map_first_output(transform: Callable[[torch.Tensor], torch.Tensor]):
    def hook(module, args, output):
        if isinstance(output, torch.Tensor):
            return transform(output)
        if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
            return (transform(output[0]),) + output[1:]
        return None

    return hook


class MoeExperts(Style):
    """Each rank runs its slice of every expert (the parameter entries split them): the tokens and
    routing weights enter through f, the partial outputs are summed (g)."""

    name = "moe_tp_experts"

    def apply(self, module, name, ctx):
        group = ctx.group

        def inputs(module, args, kwargs):
            args = list(args)
            if "hidden_states" in kwargs:
                kwargs = {**kwargs, "hidden_states": ops.copy_to_tp_region(kwargs["hidden_states"], group)}
            elif args:
                args[0] = ops.copy_to_tp_region(args[0], group)
            for position, key in ((2, "top_k_weights"), (2, "routing_weights")):
                if key in kwargs:
                    kwargs = {**kwargs, key: ops.copy_to_tp_region(kwargs[key], group)}
                    break
            else:
                if len(args) > 2 and isinstance(args[2], torch.Tensor) and args[2].is_floating_point():
                    args[2] = ops.copy_to_tp_region(args[2], group)
            return tuple(args), kwargs

        ctx.hooks.append(module.register_forward_pre_hook(inputs, with_kwargs=True))
        ctx.hooks.append(module.register_forward_hook(_map_first_output(lambda y: ops.reduce_from_tp_region(y, group))))


class MoeIdentityExpert(Style):
    """An identity expert inside ``moe_tp_experts`` returns the same on every rank, which the
    experts' sum would count tp times: its input is divided by the TP size first."""

    name = "moe_identity_expert"

    def apply(self, module, name, ctx):
        size = ctx.size
        ctx.hooks.append(module.register_forward_pre_hook(_first_arg_hook(lambda x: x / size), with_kwargs=True))


class AllReduce(Style):
    """A module computing a partial sum from split parameters (g on its output). Unless a TP
    linear inside it splits its input itself (its f), the module's floating inputs enter through
    f, so their gradients are summed too (parameters used as raw tensors: fused shared experts)."""

    name = "all_reduce"

    def apply(self, module, name, ctx):
        group = ctx.group

        def inputs(module, args, kwargs):
            if any(isinstance(getattr(m, "tp", None), LinearTP) for m in module.modules()):
                return None
            f = lambda t: ops.copy_to_tp_region(t, group) if isinstance(t, torch.Tensor) and t.is_floating_point() \
                else t  # noqa: E731
            return tuple(map(f, args)), {k: f(v) for k, v in kwargs.items()}

        ctx.hooks.append(module.register_forward_pre_hook(inputs, with_kwargs=True))
        ctx.hooks.append(module.register_forward_hook(_map_first_output(lambda y: ops.reduce_from_tp_region(y, group))))


class MlaKvAProj(Style):
    """DeepSeek-V2-style MLA: ``kv_a_proj_with_mqa``'s output is [latent | rotary key]; the latent
    part feeds a column-parallel projection (its f sums the gradient), the rotary part goes to
    attention directly, so it gets an f of its own."""

    name = "mla_kv_a_proj"

    def __init__(self, rope_dim: Optional[int] = None):
        self.rope_dim = rope_dim

    def apply(self, module, name, ctx):
        rope_dim, group = self.rope_dim, ctx.group
        if rope_dim is None:
            raise PlanError(f"torchpp plan: {name}: style 'mla_kv_a_proj' needs the config's qk_rope_head_dim")

        def split(y: torch.Tensor) -> torch.Tensor:
            latent, rope = y.split([y.size(-1) - rope_dim, rope_dim], dim=-1)
            return torch.cat([latent, ops.copy_to_tp_region(rope, group)], dim=-1)

        ctx.hooks.append(module.register_forward_hook(_map_first_output(split)))


class CopyOutput(Style):
    """A linear kept whole whose output goes both into split work directly and into column-split
    linears (``colwise_after_copy``, no f of their own): plan="auto"'s low-rank projection of MLA,
    whose rotary key every rank's heads share. One f here sums the partial gradients of both paths
    once; an f in each path too would count the second path's gradient once per rank."""

    name = "replicated_copy_output"

    def apply(self, module, name, ctx):
        group = ctx.group
        ctx.hooks.append(module.register_forward_hook(_map_first_output(lambda y: ops.copy_to_tp_region(y, group))))


class LeadingDim(Style):
    """A parameter of per-head tensors, heads first (Zamba's mixer: x_proj weights [heads, out, in]),
    split along that leading dim: each rank holds its heads' tensors whole."""

    name = "split_leading_dim"

    def apply_param(self, module, param_name, name, ctx):
        param = getattr(module, param_name)
        shard_parameter(param, Split(0, param.shape[0]), ctx, name)


class Unchanged(Style):
    """Parameters are plain local tensors here, so a module that only needs its sharded
    parameters as local tensors (transformers' ``local_params``) runs as it is."""

    name = "local_params"

    def apply(self, module, name, ctx):
        pass

    def apply_param(self, module, param_name, name, ctx):
        pass
