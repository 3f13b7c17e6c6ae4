"""Tensor-parallel styles: how one module (or one parameter) of an existing model is sharded in
place, and what happens to its input and output.

A plan maps module-name globs to style names (transformers' ``base_model_tp_plan``, torch's
``parallelize_module``); ``STYLES`` is the one registry of the names transformers' plans use,
each a few lines over ``torch.ops.torchpp``. A style shards the module's parameters in place
(same Parameter objects, so ties hold; each records its ``tp_layout``) and, for modules, gives
the module a TP forward: linears and embeddings get a class of their own (a subclass of their
class, so ``isinstance`` and state-dict names are unchanged), other modules input/output hooks.
Sharding a parameter and the gradient sums live in ``sharding``, the TP forwards of linears and
embeddings in ``tp_forwards``; here the linear, embedding and convolution styles and the registry,
in ``hook_styles`` the styles that give a module hooks or leave it as it is. The column and row
styles also split experts' linears held in one 3-D weight (``expert_linears``: every expert alike,
f and g by hooks around the module's own forward).

| style                          | parameters                      | forward                                  |
|--------------------------------|---------------------------------|------------------------------------------|
| colwise                        | rows (output features) split    | f on the input, output local             |
|                                | (a bare bias: its last dim)     |                                          |
| colwise_gather_output          | rows split                      | f on the input, output all-gathered      |
| colwise_after_copy             | rows split                      | no f: its source's output had one        |
|                                |                                 | (replicated_copy_output), output local   |
| rowwise                        | columns split, bias replicated  | input local, g (all-reduce) on output    |
| partial_sum_bias               | (parameter) replicated          | bias / tp added on each rank: a bias     |
|                                |                                 | added before the g (experts' down bias)  |
| rowwise_split_input            | columns split                   | input split, g on output                 |
| rowwise_scatter_output         | columns split, bias split       | input local, output reduce-scattered     |
| rowwise_copy_output            | columns split, bias replicated  | g then f on output (read by split work)  |
| conv_channels[(a,b,...)]       | channels split (depthwise conv) | as before, on this rank's channels       |
| packed_colwise                 | fused rows split block by block | as colwise                               |
| packed_colwise(a,b@g,...)      | as above, blocks of these sizes;| as colwise; copied rows' gradients       |
|                                | b@g: g groups, copied per group | summed over their copies                 |
|                                | where the ranks outnumber them  |                                          |
| gated_group_rmsnorm            | weight split by channels        | group statistics summed over the ranks   |
|                                |                                 | sharing a group (Mamba 2's gated norm)   |
| packed_qkv_colwise (_grouped_) | own q heads, k/v heads or copies| as colwise; f on copied k/v outputs      |
| packed_rowwise                 | fused last dim split per block  | (parameter style)                        |
| embedding_rowwise              | vocabulary split (padded)       | partial lookups summed (g)               |
| embedding_colwise              | embedding dim split             | output all-gathered                      |
| replicated_with_grad_allreduce | replicated                      | gradients summed over TP                 |
| moe_tp_experts                 | (its parameter entries)         | f on tokens and routing weights, g after |
| moe_identity_expert            | -                               | input divided by the TP size             |
| mla_kv_a_proj                  | replicated                      | f on the rotary part of the output       |
| replicated_copy_output         | replicated                      | f on the output (read directly by split  |
|                                |                                 | work and by colwise_after_copy linears)  |
| all_reduce                     | -                               | f on inputs (no TP linear inside), g out |
| split_head_inputs(a, ...)      | -                               | inputs a, ... cut to this rank's heads   |
| split_leading_dim              | (parameter) leading dim split   | per-head tensors, heads first            |
| local_widths(a, ...)           | -                               | integer attributes a, ... divided by tp  |
| local_params, replicate        | -                               | unchanged (parameters are local here)    |
"""
from __future__ import annotations

import re
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from torchpp.tensor_parallel.expert_linears import split_expert_linear
from torchpp.tensor_parallel.fused_qkv import fused_qkv_layouts
from torchpp.tensor_parallel.hook_styles import (AllReduce, CopyOutput, LeadingDim, MlaKvAProj, MoeExperts,
                                                 MoeIdentityExpert, ReplicatedWithGradAllReduce, Unchanged)
from torchpp.tensor_parallel.layouts import FusedQKV, HeadCopies, Layout, Packed, Replicated, Split
from torchpp.tensor_parallel.partial_sum_bias import PartialSumBias
# PlanError and TPContext are imported from here by the plan code (their home is sharding.py).
from torchpp.tensor_parallel.sharding import (PlanError, TPContext, full_shape, shard_parameter,
                                              sum_grads_over_copies)
from torchpp.tensor_parallel.style_base import Style  # the styles' base; imported from here too
from torchpp.tensor_parallel.tp_forwards import (EmbeddingTP, LinearTP, TPConv1DForward, TPEmbeddingForward,
                                                 TPLinearForward, _conv1d_class, _in_dim, _linear_kind,
                                                 _out_dim, _swap_class)


KEY_VALUE_NAMES = ("k_proj", "v_proj", "key", "value")


def _head_layout(out_features: int, dim: int, ctx: TPContext, name: str) -> Layout:
    """Rows of a column-split projection; key/value heads fewer than the TP ranks are copied
    onto several ranks each."""
    t, head_dim = ctx.size, ctx.head_dim
    is_key_value = name.rpartition(".")[2] in KEY_VALUE_NAMES
    if is_key_value and head_dim and ctx.num_kv_heads and out_features == ctx.num_kv_heads * head_dim \
            and ctx.num_kv_heads < t:
        kv = ctx.num_kv_heads
        if t % kv:
            raise PlanError(f"torchpp plan: {name} holds num_key_value_heads={kv} heads, which tp={t} neither "
                            f"divides nor is a multiple of")
        return HeadCopies(dim, head_dim, t // kv)
    if out_features % t:
        raise PlanError(f"torchpp plan: {name} has {out_features} output features, which tp={t} does not divide")
    return Split(dim, out_features)


class Colwise(Style):
    name = "colwise"

    def __init__(self, gather_output: bool = False, packed: int = 1, blocks: Optional[Sequence[int]] = None,
                 fused_qkv: Optional[str] = None, groups: Optional[Sequence[int]] = None, input_copied: bool = False):
        self.gather_output, self.packed, self.blocks, self.fused_qkv = gather_output, packed, blocks, fused_qkv
        self.input_copied = input_copied  # an f upstream (replicated_copy_output) sums its input's gradient
        self.groups = groups  # per block: how many groups it holds (copied where the ranks outnumber them)

    def layouts(self, module, name, ctx) -> Tuple[Layout, Layout]:
        """(weight layout, bias layout) of the linear ``module`` (also what plan="auto" simulates)."""
        dim = _out_dim(_linear_kind(module, name, self.name))
        out_features = full_shape(module.weight, ctx)[dim]
        if self.blocks is not None:
            layout = Packed(dim, _blocks_of(self.blocks, out_features, name), self.groups)
            return layout, Packed(0, layout.blocks, self.groups)
        if self.fused_qkv:  # "blocks" [q | k | v] or "grouped" per key/value head
            return fused_qkv_layouts(out_features, dim, ctx, name, grouped=self.fused_qkv == "grouped")
        if self.packed > 1:
            if out_features % self.packed:
                raise PlanError(f"torchpp plan: {name} ({out_features} output features) is not {self.packed} "
                                f"equal fused blocks")
            layout: Layout = Packed(dim, [out_features // self.packed] * self.packed)
            bias_layout: Layout = Packed(0, layout.blocks)
        elif self.gather_output:
            layout, bias_layout = Split(dim, out_features, pad=True), Split(0, out_features, pad=True)
        else:
            layout = _head_layout(out_features, dim, ctx, name)
            bias_layout = (HeadCopies(0, layout.head_dim, layout.replicas) if isinstance(layout, HeadCopies)
                           else Split(0, out_features))
        return layout, bias_layout

    def apply(self, module, name, ctx):
        kind = _linear_kind(module, name, self.name)
        out_features = full_shape(module.weight, ctx)[_out_dim(kind)]
        layout, bias_layout = self.layouts(module, name, ctx)
        shard_parameter(module.weight, layout, ctx, f"{name}.weight")
        if getattr(module, "bias", None) is not None:  # expert linears have none
            shard_parameter(module.bias, bias_layout, ctx, f"{name}.bias")
        copies = isinstance(layout, HeadCopies) or getattr(module.weight, "tp_grad_sum", None) == "rows"
        copied = layout.copied_features(ctx.size) if isinstance(layout, FusedQKV) else 0
        for param in (module.weight, getattr(module, "bias", None)):
            if isinstance(layout, HeadCopies) and param is not None:
                sum_grads_over_copies(param, ctx)
        if kind == "experts":  # its own forward on every expert's shard; the f by a hook
            if self.gather_output or copies or copied:
                raise PlanError(f"torchpp plan: {name} holds experts' linears, which style {self.name!r} "
                                f"cannot split (their outputs are not gathered nor copied)")
            if not self.input_copied:
                split_expert_linear(module, ctx, column=True)
            return
        _swap_class(module, TPLinearForward if kind == "linear" else TPConv1DForward,
                    nn.Linear if kind == "linear" else _conv1d_class(), name, self.name)
        # Copies' gradients are summed by a hook, which a deferred (W pass) gradient would skip; copied
        # key/value rows run as two linears on slices of the weight, no leaf for a W pass.
        # out_features stays the whole layer's, as transformers' own TP keeps it (models read it).
        module.tp = LinearTP(ctx.group, column=True, gather_output=self.gather_output, out_features=out_features,
                             split_bw=ctx.split_bw and not copies and not copied, copied_features=copied,
                             input_copied=self.input_copied,
                             copy_slot=layout.copy_slot(ctx.rank, ctx.size) if copied else (0, 1, True))

    def param_layout(self, param: torch.Tensor, param_name: str = "") -> Layout:
        """The layout of a bare parameter the plan names (a fused expert tensor, a per-head vector):
        a weight's output dim (the second last), a bias's last (experts' [E, out] biases)."""
        dim = param.dim() - 1 if param_name.endswith("bias") else max(param.dim() - 2, 0)
        if self.packed > 1:
            return Packed(dim, [param.shape[dim] // self.packed] * self.packed)
        return Split(dim, param.shape[dim])

    def apply_param(self, module, param_name, name, ctx):
        param = getattr(module, param_name)
        shard_parameter(param, self.param_layout(param, param_name), ctx, name)


class Rowwise(Style):
    name = "rowwise"

    def __init__(self, split_input: bool = False, packed: int = 1, scatter_output: bool = False,
                 copy_output: bool = False):
        self.split_input, self.packed, self.scatter_output = split_input, packed, scatter_output
        self.copy_output = copy_output  # Mamba's x_proj: its whole output feeds the per-channel scan

    def layouts(self, module, name, ctx) -> Tuple[Layout, Layout]:
        """(weight layout, bias layout) of the linear ``module`` (the bias is added after the reduction)."""
        dim = _in_dim(_linear_kind(module, name, self.name))
        in_features = full_shape(module.weight, ctx)[dim]
        if in_features % ctx.size:
            raise PlanError(f"torchpp plan: {name} has {in_features} input features, which tp={ctx.size} does "
                            f"not divide")
        bias = getattr(module, "bias", None)
        return Split(dim, in_features), (Split(0, bias.shape[0]) if self.scatter_output and bias is not None
                                         else Replicated())

    def apply(self, module, name, ctx):
        kind = _linear_kind(module, name, self.name)
        layout, bias_layout = self.layouts(module, name, ctx)
        shard_parameter(module.weight, layout, ctx, f"{name}.weight")
        if getattr(module, "bias", None) is not None:  # expert linears have none
            shard_parameter(module.bias, bias_layout, ctx, f"{name}.bias")
        if kind == "experts":  # its own forward on every expert's shard; the g by a hook
            if self.split_input or self.scatter_output or self.copy_output:
                raise PlanError(f"torchpp plan: {name} holds experts' linears; style {self.name!r} is for linears, "
                                f"use 'rowwise'")
            split_expert_linear(module, ctx, column=False)
            return
        _swap_class(module, TPLinearForward if kind == "linear" else TPConv1DForward,
                    nn.Linear if kind == "linear" else _conv1d_class(), name, self.name)
        module.tp = LinearTP(ctx.group, column=False, split_input=self.split_input, split_bw=ctx.split_bw,
                             scatter_output=self.scatter_output, copy_output=self.copy_output)

    def apply_param(self, module, param_name, name, ctx):
        param = getattr(module, param_name)
        shard_parameter(param, self.param_layout(param, param_name), ctx, name)

    def param_layout(self, param: torch.Tensor, param_name: str = "") -> Layout:
        """The layout of a bare parameter the plan names (a fused expert tensor): its last dim
        split; a bias whole (added after the reduction; one added before it: ``partial_sum_bias``)."""
        if param_name.endswith("bias"):
            return Replicated()
        if self.packed > 1:
            return Packed(param.dim() - 1, [param.shape[-1] // self.packed] * self.packed)
        return Split(param.dim() - 1, param.shape[-1])


class PackedRowwise(Rowwise):
    name = "packed_rowwise"

    def __init__(self):
        super().__init__(packed=2)

    def apply(self, module, name, ctx):
        raise PlanError(f"torchpp plan: style 'packed_rowwise' applies to fused parameters, but {name} is a "
                        f"{type(module).__name__} module")


class Embedding(Style):
    name = "embedding_rowwise"

    def __init__(self, vocab_parallel: bool = True):
        self.vocab_parallel = vocab_parallel

    def apply(self, module, name, ctx):
        if not isinstance(module, nn.Embedding):
            raise PlanError(f"torchpp plan: style {self.name!r} shards embeddings, but {name} is a "
                            f"{type(module).__name__}")
        if module.max_norm is not None or module.sparse:
            raise PlanError(f"torchpp plan: {name}: max_norm and sparse embeddings are not sharded")
        rows, cols = full_shape(module.weight, ctx)
        if self.vocab_parallel:
            shard_parameter(module.weight, Split(0, rows, pad=True), ctx, f"{name}.weight")
            per_rank = module.weight.shape[0]
            tp = EmbeddingTP(ctx.group, True, ctx.rank * per_rank, (ctx.rank + 1) * per_rank)
        else:
            if cols % ctx.size:
                raise PlanError(f"torchpp plan: {name} has embedding dim {cols}, which tp={ctx.size} does not divide")
            shard_parameter(module.weight, Split(1, cols), ctx, f"{name}.weight")
            tp = EmbeddingTP(ctx.group, False)
        _swap_class(module, TPEmbeddingForward, nn.Embedding, name, self.name)
        module.tp = tp


class ConvChannels(Style):
    """A depthwise ``nn.Conv1d`` (one filter per channel: Mamba's short convolution) on the
    channels a column split gives this rank: weight and bias split by channel (block by block
    where its channels are fused blocks, ``conv_channels(x,b,c)``), its channel and group counts
    this rank's."""

    name = "conv_channels"

    def __init__(self, blocks: Optional[Sequence[int]] = None, groups: Optional[Sequence[int]] = None):
        self.blocks, self.groups = blocks, groups

    def apply(self, module, name, ctx):
        if not isinstance(module, nn.Conv1d) or not module.in_channels == module.out_channels == module.groups:
            raise PlanError(f"torchpp plan: style 'conv_channels' splits a depthwise nn.Conv1d (groups = channels), "
                            f"but {name} is {module!r}")
        channels = module.out_channels
        layout = (Split(0, channels) if self.blocks is None
                  else Packed(0, _blocks_of(self.blocks, channels, name), self.groups))
        for param_name in ("weight", "bias"):
            if getattr(module, param_name) is not None:
                shard_parameter(getattr(module, param_name), layout, ctx, f"{name}.{param_name}")
        module.in_channels = module.out_channels = module.groups = module.weight.shape[0]


def _blocks_of(blocks: Sequence[int], width: int, name: str) -> List[int]:
    if sum(blocks) != width:
        raise PlanError(f"torchpp plan: {name} is {width} wide, but its fused blocks {list(blocks)} sum to "
                        f"{sum(blocks)}")
    return list(blocks)


def _named(style: Style, name: str) -> Style:
    style.name = name
    return style


STYLES: Dict[str, Style] = {
    "colwise": _named(Colwise(), "colwise"),
    "colwise_rep": _named(Colwise(gather_output=True), "colwise_rep"),
    "colwise_gather_output": _named(Colwise(gather_output=True), "colwise_gather_output"),
    "colwise_after_copy": _named(Colwise(input_copied=True), "colwise_after_copy"),  # torchpp's: plan="auto"'s MLA
    "packed_colwise": _named(Colwise(packed=2), "packed_colwise"),
    "packed3_colwise": _named(Colwise(packed=3), "packed3_colwise"),  # torchpp's: fused q, k, v (GPT-2)
    # torchpp's: fused q, k, v of unequal widths (multi-query attention), key/value heads copied where needed
    "packed_qkv_colwise": _named(Colwise(fused_qkv="blocks"), "packed_qkv_colwise"),
    "packed_qkv_grouped_colwise": _named(Colwise(fused_qkv="grouped"), "packed_qkv_grouped_colwise"),
    "rowwise": _named(Rowwise(), "rowwise"),
    "rowwise_split_input": _named(Rowwise(split_input=True), "rowwise_split_input"),
    "rowwise_rep": _named(Rowwise(split_input=True), "rowwise_rep"),
    "rowwise_scatter_output": _named(Rowwise(scatter_output=True), "rowwise_scatter_output"),
    "rowwise_copy_output": _named(Rowwise(copy_output=True), "rowwise_copy_output"),
    "conv_channels": ConvChannels(),
    "packed_rowwise": PackedRowwise(),
    "embedding_rowwise": _named(Embedding(vocab_parallel=True), "embedding_rowwise"),
    "embedding_colwise": _named(Embedding(vocab_parallel=False), "embedding_colwise"),
    "replicated_with_grad_allreduce": ReplicatedWithGradAllReduce(),
    "moe_tp_experts": MoeExperts(),
    "partial_sum_bias": PartialSumBias(),  # torchpp's: per-expert down biases under moe_tp_experts
    "moe_identity_expert": MoeIdentityExpert(),
    "mla_kv_a_proj": MlaKvAProj(),
    "replicated_copy_output": CopyOutput(),
    "all_reduce": AllReduce(),
    "split_leading_dim": LeadingDim(),
    "local_params": Unchanged(),
    "replicate": _named(Unchanged(), "replicate"),
}


# Styles that take a fused output's block sizes: ``packed_colwise(4096,4096,256,256,64)``.
BLOCK_STYLES: Dict[str, Callable[[List[int], List[int]], Style]] = {
    "packed_colwise": lambda blocks, groups: Colwise(blocks=blocks, groups=groups),
    "conv_channels": lambda blocks, groups: ConvChannels(blocks, groups),
}


def get_style(name: str, where: str, config=None) -> Style:
    """The style registered as ``name``, or a block style with its sizes (a clear error naming
    the plan entry otherwise)."""
    if name == "mla_kv_a_proj" and config is not None:
        return MlaKvAProj(getattr(config, "qk_rope_head_dim", None))
    sized = re.fullmatch(r"(\w+)\(([\d@, ]+)\)", name)
    if sized and sized.group(1) in BLOCK_STYLES:  # "a,b@g,...": a block of b in g groups
        blocks = [block.strip().partition("@") for block in sized.group(2).split(",")]
        style = BLOCK_STYLES[sized.group(1)]([int(size) for size, _, _ in blocks],
                                             [int(groups or 0) for _, _, groups in blocks])
        return _named(style, name)
    if name == "gated_group_rmsnorm":  # (its module imports this one)
        from torchpp.tensor_parallel.group_norm import GatedGroupRMSNorm

        return GatedGroupRMSNorm()
    if name.startswith("split_head_inputs("):  # parameterised by the inputs it slices
        from torchpp.tensor_parallel.head_inputs import head_inputs_style_of

        style = head_inputs_style_of(name)
        if style is not None:
            return style
    if name.startswith("local_widths("):  # parameterised by the attributes it divides
        from torchpp.tensor_parallel.local_widths import local_widths_style_of

        style = local_widths_style_of(name)
        if style is not None:
            return style
    if name not in STYLES:
        raise PlanError(f"torchpp plan: unknown style {name!r} for {where}; known styles: {sorted(STYLES)}")
    return STYLES[name]
