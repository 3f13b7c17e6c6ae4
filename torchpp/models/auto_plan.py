"""plan="auto": a TP and PP plan derived from a transformers model's module structure, for models
whose config carries none (DeepSpeed's AutoTP idea: linears reading the residual stream are
split by columns, those writing back into it by rows).

- The stack of layers is the longest ``nn.ModuleList`` that no layer of another holds (``find_stack``).
- One traced forward on a few tokens follows, in each layer, the autograd graph between the
  ``nn.Linear``s: a linear whose input comes from the layer's input through no other linear
  *reads* the residual stream (so does one whose input also mixes in outputs of linears kept
  whole, which every rank computes whole: a hyper-connection's stream mix); one whose output
  reaches the layer's output through no other linear *writes* back into it. A writer is
  ``rowwise`` and the readers feeding it ``colwise``; parameters met between them (per-head norms)
  see head-split activations, so their gradients are summed over TP; a norm over a reader's whole
  width (every head at once) makes that group gather its outputs instead
  (``colwise_gather_output``, the writer ``rowwise_split_input``, as transformers' OLMo 2 plan
  does). A reader that also writes (a router's gate) stays replicated.
- A low-rank projection of whole inputs that a linear reading nothing else widens back up (MLA's
  q_a and kv_a, a LoRA adapter's A) stays whole, as Megatron keeps MLA's down projections; what
  widens it reads a whole tensor and is a group's reader. Where the latent also reaches the
  writer directly (MLA's rotary key), the group's f sits on the latent's output
  (``replicated_copy_output``) and its widening linear has none (``colwise_after_copy``).
- What the rule cannot decide stays whole (replicated), as DeepSpeed's AutoTP leaves the linears
  it does not recognise: a linear between two others (a state-space mixer's ``x_proj``, a
  router's inner MLP), and every group depending on one: where a
  reader's output goes two ways (into its writer and back into the stream), where a linear other
  than the writer reads a reader's output (it would see a shard), or where the group shares a
  reader with such a group. The other groups of the layer still split. The log names each module
  kept whole and why, one line each; ``PlanError`` only where nothing splits, naming why.
- Attention modules that count their heads in attributes (``num_heads``, ``embed_dim``) get
  this rank's counts after the split (as DeepSpeed's AutoTP does).
- Mamba 2 mixers (hybrid families' too) take Megatron's split instead of the rule's
  (``torchpp.models.mamba_plans``), where tp divides their groups.
- Experts held as raw 3-D parameters (``gate_up_proj`` / ``up_proj`` and ``down_proj``) split as
  transformers' own MoE plans split them (``torchpp.models.auto_experts``), where the trial holds;
  experts' linears in one 3-D weight that a forward applies expert by expert (JetMoE's) are
  linears to the rule (``torchpp.tensor_parallel.expert_linears``).
- Given the TP size, each group is first tried on one layer in this process
  (``torchpp.models.auto_check``): one whose split fails or changes the result stays whole.
- A bias built outside the attention for every head (ALiBi) is cut to each rank's heads where
  that split alone holds in the trial: the attention module gets ``split_head_inputs(...)``
  (``torchpp.tensor_parallel.head_inputs``).

Embeddings and the output layer stay replicated. ``auto_plans`` logs the plan it chose, what it
keeps whole and how many linears of each layer kind it splits (INFO on the ``torchpp`` logger) and
returns the plan; ``describe_plan`` formats it.
"""
from __future__ import annotations

import logging
from typing import Dict, List, Optional, Tuple

from torch import nn

from torchpp.models.auto_experts import ExpertCalls, experts_parameters
from torchpp.models.auto_fused_qkv import FUSED_QKV_STYLES, local_key_value_counts
from torchpp.models.auto_trace import PACKED_STYLES, WHOLE_STYLES, LayerTrace, is_linear
from torchpp.models.plans import layout_around, text_config
from torchpp.models.stages import PipelineLayout, get_submodule
from torchpp.models.traced_forward import traced_forward, untracked_layers_error
from torchpp.tensor_parallel.plan import glob_pattern
from torchpp.tensor_parallel.styles import PlanError, TPContext

LOG = logging.getLogger("torchpp")
# Attributes in which attention modules count their (query / key-value) heads or their width:
# divided by tp on a branch whose projections are split (modules that reshape by -1 read none).
HEAD_ATTRIBUTES = ("num_heads", "num_attention_heads", "n_head", "n_heads", "num_key_value_heads", "num_kv_heads",
                   "embed_dim", "all_head_size", "inner_dim", "split_size")


def find_stack(model: nn.Module) -> str:
    """The path of the longest ``nn.ModuleList`` that no layer of another holds (a list inside a
    layer, its experts or adapters, is part of that layer) and whose layers run on token ids (not a
    vision tower's); at equal lengths one whose layers are all of one class, then the first
    registered. A hybrid model's layers may be of several classes (Zamba 2's Mamba and hybrid layers)."""
    best: Optional[Tuple[int, bool, str]] = None
    lists = [(name, module) for name, module in model.named_modules() if isinstance(module, nn.ModuleList)
             and len(module) > 0]
    outer = [(name, module) for name, module in lists if not any(name.startswith(f"{o}.") for o, _ in lists)]
    ran = _running_lists(model, outer)  # a vision tower's layers do not run on token ids: not the stack
    for name, module in outer:
        if ran and name not in ran:
            continue
        key = (len(module), len({type(m) for m in module}) == 1)
        if best is None or key > best[:2]:
            best = (*key, name)
    if best is None:
        raise PlanError(f"torchpp.parallelize(plan='auto'): {type(model).__name__} has no nn.ModuleList of "
                        f"layers to cut into pipeline stages; pass plan=")
    return best[2]


def _running_lists(model: nn.Module, lists) -> set:
    """The names of ``lists`` whose first layer runs in a forward on a few token ids (empty when the
    model cannot run here: built on the meta device, or its forward needs more than token ids)."""
    if any(p.is_meta for p in model.parameters()):
        return set()
    ran: set = set()
    hooks = [module[0].register_forward_pre_hook(lambda *_, name=name: ran.add(name)) for name, module in lists]
    try:
        traced_forward(model, grad=False)
    except Exception:  # noqa: BLE001 - judged by registration alone
        return set()
    finally:
        for hook in hooks:
            hook.remove()
    return ran


def auto_plans(model: nn.Module, tp: int = 1, ctx: Optional[TPContext] = None
               ) -> Tuple[Dict[str, str], PipelineLayout]:
    """(TP plan, pipeline layout) of ``model`` derived as the module docstring says.

    Args:
        model: a transformers model with weights (it runs once on a few tokens).
        tp: the TP size the plan is for: each group the rule splits is first tried on one layer
            in this process (``torchpp.models.auto_check``) and stays whole where the split would
            fail or change the layer's result. 1: nothing is tried.
        ctx: the TP context (size and head counts) to try, where the caller has one (parallelize).

    Raises:
        PlanError: where nothing in the stack splits, naming the first module kept whole and why
            (or why no trace ran).
    """
    stack = find_stack(model)
    layers = list(get_submodule(model, stack))
    if any(p.is_meta for p in model.parameters()):
        raise PlanError("torchpp.parallelize(plan='auto') runs the model once on a few tokens to read its structure; "
                        "a meta-device model cannot run: build it with weights, or pass plan=")
    traces = [LayerTrace(layer, f"{stack}.{i}", _layer_heads(text_config(model), i)) for i, layer in enumerate(layers)]
    experts = ExpertCalls(model, stack)
    try:
        traced_forward(model)
    finally:
        for trace in traces:
            trace.remove()
        experts.remove()
    untracked = [i for i, trace in enumerate(traces) if trace.untracked]
    if untracked:
        raise untracked_layers_error(model, stack, untracked, "plan='auto' reads each layer's autograd graph; "
                                     "pass plan=")
    groups = [trace.decide() for trace in traces]
    whole = {f"{trace.path}.{name}": why for trace in traces for name, why in trace.whole.items()}
    trial = None  # the TP context each split is tried at, in this process
    if ctx is not None or tp > 1:
        from torchpp.models.auto_check import keep_groups_that_split, sized_context

        trial = ctx or sized_context(model, tp)
        groups, failing = keep_groups_that_split(traces, groups, trial)
        whole.update(failing)
    mixers: Dict[str, str] = {}
    if ctx is not None or tp > 1:  # Mamba mixers: Megatron's split, beyond the rule (models.mamba_plans)
        from torchpp.models.mamba_plans import mamba_mixers

        mixers, mixers_whole = mamba_mixers(model, stack, ctx.size if ctx is not None else tp)
        owners = {name.rpartition(".")[0] + "." for name in list(mixers) + list(mixers_whole)}
        groups = [[{n: s for n, s in group.items() if not n.startswith(tuple(owners))} for group in layer_groups]
                  for layer_groups in groups]
        whole = {n: why for n, why in whole.items() if not n.startswith(tuple(owners))}
        whole.update(mixers_whole)
    plan: Dict[str, str] = {name: style for layer_groups in groups for group in layer_groups
                            for name, style in group.items()}
    plan.update(mixers)
    if trial is not None:  # experts of raw 3-D weights: transformers' own split (models.auto_experts)
        split_experts, experts_whole = experts.plan(trial, plan)
        plan.update(split_experts)
        whole.update(experts_whole)
    if not plan:
        _raise_nothing_to_split(stack, tp, whole)
    plan, whole = _as_globs(plan, stack, len(layers)), _as_globs(whole, stack, len(layers))
    LOG.info("torchpp.parallelize(plan='auto') for %s:\n%s\n  linears split per layer: %s", type(model).__name__,
             describe_plan(plan, stack, whole), split_counts(model, stack, lambda name, _: _planned(name, plan)))
    return plan, layout_around(model, stack)


def _raise_nothing_to_split(stack: str, tp: int, whole: Dict[str, str]) -> None:
    """A wrap that splits nothing gives nothing over tp: the first module kept whole says why."""
    if not whole:
        raise PlanError(f"torchpp.parallelize(plan='auto'): no layer of {stack} has an nn.Linear reading its residual "
                        f"stream that feeds one writing back into it: nothing to split; pass plan=")
    groups = [(name, why) for name, why in whole.items() if why.startswith("with its readers")]
    name, why = (groups or list(whole.items()))[0]  # a group that would split, else the first linear
    more = f" (and {len(whole) - 1} more kept whole)" if len(whole) > 1 else ""
    raise PlanError(f"torchpp.parallelize(plan='auto'): nothing in {stack} splits{f' over tp={tp}' if tp > 1 else ''}: "
                    f"{name} stays whole: {why}{more}; pass plan=")


def describe_plan(plan: Dict[str, str], stack: str, whole: Optional[Dict[str, str]] = None) -> str:
    """One line per entry, one per module kept whole (replicated) and why, and the stack the pipeline cuts."""
    lines = [f"  {name}: {style}" for name, style in sorted(plan.items())]
    lines += [f"  {name}: kept whole ({reason})" for name, reason in _brace_layers(whole or {}, stack)]
    return "\n".join(lines + [f"  pipeline stack: {stack}"])


def _brace_layers(entries: Dict[str, str], stack: str) -> List[Tuple[str, str]]:
    """Entries alike but for the layer index in one line: ``stack.{0,2}.name`` (a hybrid's layers of one kind)."""
    indices: Dict[Tuple[str, str], List[str]] = {}
    for name, text in entries.items():
        index, _, rest = name[len(stack) + 1:].partition(".")
        indices.setdefault((rest, text), []).append(index)
    return sorted((f"{stack}.{ids[0] if len(ids) == 1 else '{' + ','.join(ids) + '}'}.{rest}", text)
                  for (rest, text), ids in indices.items())


def split_counts(model: nn.Module, stack: str, is_split) -> str:
    """How many of each layer's linears are split, per layer class of the stack: ``"Block 4/6"``
    (``"Block 0-4/6"`` where layers of one class differ).

    Args:
        model: the model (wrapped or not).
        stack: the path of its layers.
        is_split: (linear's name in the model, the linear) -> whether it is split.
    """
    per_class: Dict[str, List[Tuple[int, int]]] = {}
    for i, layer in enumerate(get_submodule(model, stack)):
        names = [f"{stack}.{i}.{name}" for name, module in layer.named_modules()
                 if is_linear(module) or experts_parameters(module) is not None]
        modules = dict(layer.named_modules())
        split = sum(bool(is_split(name, modules[name[len(f"{stack}.{i}."):]])) for name in names)
        per_class.setdefault(type(layer).__name__, []).append((split, len(names)))
    parts = []
    for kind, counts in per_class.items():
        low, high, total = min(c[0] for c in counts), max(c[0] for c in counts), max(c[1] for c in counts)
        parts.append(f"{kind} {low if low == high else f'{low}-{high}'}/{total}")
    return ", ".join(parts)


def _planned(name: str, plan: Dict[str, str]) -> bool:
    """Whether a plan of globs splits the module ``name`` (or its weight: Mamba's dt_proj)."""
    return any(style not in WHOLE_STYLES and (glob_pattern(glob).match(name) or glob_pattern(
        glob.rpartition(".")[0]).match(name) and glob.endswith(".weight")) for glob, style in plan.items())


def divide_head_attributes(model: nn.Module, plan: Dict[str, str], ctx: TPContext, done=()) -> None:
    """Gives the modules holding split projections this rank's head counts and widths (but those
    named in ``done``: their counts are this rank's already)."""
    owners = {name.rpartition(".")[0] for name, style in plan.items()
              if style in ("colwise", "colwise_after_copy", *PACKED_STYLES.values(), *FUSED_QKV_STYLES)}
    fused = {name.rpartition(".")[0] for name, style in plan.items() if style in FUSED_QKV_STYLES}
    for name, module in model.named_modules():
        if name in done or not any(glob_pattern(owner).match(name) for owner in owners):
            continue
        for attribute in HEAD_ATTRIBUTES:
            value = getattr(module, attribute, None)
            if isinstance(value, int) and not isinstance(value, bool) and value % ctx.size == 0:
                setattr(module, attribute, value // ctx.size)
        if any(glob_pattern(owner).match(name) for owner in fused):
            local_key_value_counts(module, ctx.size)


def _as_globs(plan: Dict[str, str], stack: str, num_layers: int) -> Dict[str, str]:
    """Entries every layer shares become one ``stack.*.name`` glob."""
    per_name: Dict[str, Dict[int, str]] = {}
    for name, style in plan.items():
        index, _, rest = name[len(stack) + 1:].partition(".")
        per_name.setdefault(rest, {})[int(index)] = style
    out: Dict[str, str] = {}
    for rest, styles in per_name.items():
        if len(styles) == num_layers and len(set(styles.values())) == 1:
            out[f"{stack}.*.{rest}"] = next(iter(styles.values()))
        else:
            out.update({f"{stack}.{i}.{rest}": style for i, style in styles.items()})
    return out


def _layer_heads(config, index: int) -> set:
    """The query and key/value head counts of layer ``index``: its own under a heterogeneous
    config (transformers' per-layer configs refuse a model-wide read), else the model's."""
    from torchpp.models.passes.resolve import config_value

    if getattr(config, "is_heterogeneous", False):
        config = config.per_layer_config[index]
    return {config_value(config, key) for key in ("num_attention_heads", "num_key_value_heads")} - {None}
