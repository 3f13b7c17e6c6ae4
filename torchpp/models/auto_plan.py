"""plan="auto": a TP and PP plan derived from a transformers model's module structure, for models
whose config carries none (DeepSpeed's AutoTP idea: linears reading the residual stream are
split by columns, those writing back into it by rows).

- The stack of layers is the longest ``nn.ModuleList`` that no layer of another holds (``find_stack``).
- One traced forward on a few tokens follows, in each layer, the autograd graph between the
  ``nn.Linear``s: a linear whose input comes from the layer's input through no other linear
  *reads* the residual stream; one whose output reaches the layer's output through no other
  linear *writes* back into it. A writer is ``rowwise`` and the readers feeding it ``colwise``;
  parameters met between them (per-head norms) see head-split activations, so their gradients
  are summed over TP; a norm over a reader's whole width (every head at once) makes that group
  gather its outputs instead (``colwise_gather_output``, the writer ``rowwise_split_input``,
  as transformers' OLMo 2 plan does). A reader that also writes (a router's gate) stays replicated. A linear
  between two others (a low-rank projection's second half, a state-space model's inner
  projections) is a case the rule cannot decide: ``PlanError`` names it.
- Attention modules that count their heads in attributes (``num_heads``, ``embed_dim``) get
  this rank's counts after the split (as DeepSpeed's AutoTP does).
- Given the TP size, each group is first tried on one layer in this process
  (``torchpp.models.auto_check``): one whose split fails or changes the result stays whole.

Embeddings and the output layer stay replicated. ``auto_plans`` logs the plan it chose (INFO
on the ``torchpp`` logger) and returns it; ``describe_plan`` formats it.
"""
from __future__ import annotations

import logging
import re
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from torchpp.models.autograd_walk import history, leaving_no_history, walk_back
from torchpp.models.plans import layout_around, text_config
from torchpp.models.stages import PipelineLayout, get_submodule
from torchpp.tensor_parallel.styles import PlanError, TPContext

LOG = logging.getLogger("torchpp")
TRACE_TOKENS = 8
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
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    ids = (torch.arange(TRACE_TOKENS, device=device) % (getattr(text_config(model), "vocab_size", None) or 2))
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[] if device.type == "cpu" else [device],
                                                    device_type=device.type):
            model(input_ids=ids.unsqueeze(0), use_cache=False)
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
        PlanError: naming the module where the rule cannot decide (or why no trace ran).
    """
    stack = find_stack(model)
    layers = list(get_submodule(model, stack))
    if any(p.is_meta for p in model.parameters()):
        raise PlanError("torchpp.parallelize(plan='auto') runs the model once on a few tokens to read its structure; "
                        "a meta-device model cannot run: build it with weights, or pass plan=")
    traces = [_LayerTrace(layer, f"{stack}.{i}", _layer_heads(text_config(model), i)) for i, layer in enumerate(layers)]
    vocab = getattr(text_config(model), "vocab_size", None) or 2
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    ids = (torch.arange(TRACE_TOKENS, device=device) % vocab).unsqueeze(0)
    try:
        with torch.enable_grad(), leaving_no_history(model), torch.random.fork_rng(
                devices=[] if device.type == "cpu" else [device], device_type=device.type):
            model(input_ids=ids, use_cache=False)
    finally:
        for trace in traces:
            trace.remove()
    groups = [trace.decide() for trace in traces]
    whole = {f"{trace.path}.{name}": why for trace in traces for name, why in trace.whole.items()}
    if ctx is not None or tp > 1:
        from torchpp.models.auto_check import keep_groups_that_split, sized_context

        groups, failing = keep_groups_that_split(traces, groups, ctx or sized_context(model, tp))
        whole.update(failing)
    plan: Dict[str, str] = {name: style for layer_groups in groups for group in layer_groups
                            for name, style in group.items()}
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
    raise PlanError(f"torchpp.parallelize(plan='auto'): nothing in {stack} can be split{f' over tp={tp}' if tp > 1 else ''} (no "
                    f"nn.Linear reading its residual stream feeds one writing back into it that splits): {name} stays "
                    f"whole: {why}{more}; pass plan=")


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
        names = [f"{stack}.{i}.{name}" for name, module in layer.named_modules() if _is_linear(module)]
        modules = dict(layer.named_modules())
        split = sum(bool(is_split(name, modules[name[len(f"{stack}.{i}."):]])) for name in names)
        per_class.setdefault(type(layer).__name__, []).append((split, len(names)))
    parts = []
    for kind, counts in per_class.items():
        low, high, total = min(c[0] for c in counts), max(c[0] for c in counts), max(c[1] for c in counts)
        parts.append(f"{kind} {low if low == high else f'{low}-{high}'}/{total}")
    return ", ".join(parts)


def _planned(name: str, plan: Dict[str, str]) -> bool:
    """Whether a plan of globs splits the module ``name``."""
    return any(style != "replicated_with_grad_allreduce" and re.fullmatch(_glob_regex(glob), name)
               for glob, style in plan.items())


def divide_head_attributes(model: nn.Module, plan: Dict[str, str], ctx: TPContext) -> None:
    """Gives the modules holding split projections this rank's head counts and widths."""
    owners = {name.rpartition(".")[0] for name, style in plan.items() if style in ("colwise", *PACKED_STYLES.values())}
    for name, module in model.named_modules():
        if not any(re.fullmatch(_glob_regex(owner), name) for owner in owners):
            continue
        for attribute in HEAD_ATTRIBUTES:
            value = getattr(module, attribute, None)
            if isinstance(value, int) and not isinstance(value, bool) and value % ctx.size == 0:
                setattr(module, attribute, value // ctx.size)


def _glob_regex(glob: str) -> str:
    return re.escape(glob).replace(r"\*", r"[^.]+")


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


# A reader whose output is split into equal parts along its features (fused q, k, v; fused gate
# and up) is split part by part.
PACKED_STYLES = {2: "packed_colwise", 3: "packed3_colwise"}


def _is_linear(module: nn.Module) -> bool:
    """nn.Linear, or transformers' Conv1D (GPT-2's linears, weight [in, out]; also once a TP class is swapped in)."""
    return isinstance(module, nn.Linear) or (any(c.__name__ == "Conv1D" for c in type(module).__mro__) and
                                             getattr(module, "weight", None) is not None and module.weight.dim() == 2)


def _packed_outputs(nodes, outputs: Dict[int, str]) -> Dict[str, int]:
    """{linear: number of equal parts} for linears whose output a split along the last dimension
    cuts into equal parts (the nodes of a walk that met them)."""
    found: Dict[str, int] = {}
    for node in nodes:
        kind = type(node).__name__
        if not kind.startswith("Split"):
            continue
        sources = [outputs.get(id(n)) for n, _ in node.next_functions if n is not None]
        sizes = getattr(node, "_saved_self_sym_sizes", None)
        dim = getattr(node, "_saved_dim", None)
        if not sizes or dim is None or not any(sources):
            continue
        dim = dim - 2**64 if dim >= 2**63 else dim
        if dim % len(sizes) != len(sizes) - 1:
            continue
        parts = getattr(node, "_saved_split_sizes", None)
        count = len(parts) if parts and len(set(parts)) == 1 else (
            int(sizes[-1]) // int(node._saved_split_size) if hasattr(node, "_saved_split_size") else 1)
        for source in filter(None, sources):
            found[source] = count
    return found


def _first_tensor(value) -> Optional[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        return next((t for t in map(_first_tensor, value) if t is not None), None)
    if isinstance(value, dict):  # transformers' ModelOutput is one
        return _first_tensor(list(value.values()))
    return None


def _layer_heads(config, index: int) -> set:
    """The query and key/value head counts of layer ``index``: its own under a heterogeneous
    config (transformers' per-layer configs refuse a model-wide read), else the model's."""
    from torchpp.models.passes.resolve import config_value

    if getattr(config, "is_heterogeneous", False):
        config = config.per_layer_config[index]
    return {config_value(config, key) for key in ("num_attention_heads", "num_key_value_heads")} - {None}


class _LayerTrace:
    """Hooks on one layer and its linears; the decision from what they saw (module docstring)."""

    def __init__(self, layer: nn.Module, path: str, heads=()):
        self.path, self.heads = path, set(heads)
        self.layer, self.call = layer, None
        self.input: Optional[torch.Tensor] = None
        self.output: Optional[torch.Tensor] = None
        self.linears: Dict[str, Tuple[torch.Tensor, torch.Tensor]] = {}
        # What made the layer's input and output and each linear's, recorded as they ran (autograd_walk.history).
        self.entry = self.exit = None
        self.made: Dict[str, Tuple[object, object]] = {}
        self.owners: Dict[int, str] = {}  # id of a parameter -> the module holding it (not a linear)
        self._params = [p for name, m in layer.named_modules() if name and not _is_linear(m)
                        for p in m.parameters(recurse=False)]
        self.param_names = {id(p): f"{path}.{name}" for name, p in layer.named_parameters()}
        for name, module in layer.named_modules():
            if not _is_linear(module):  # the layer itself too: parameters held by the attention block directly
                self.owners.update({id(p): f"{path}.{name}".rstrip(".") for p in module.parameters(recurse=False)})
        self._hooks = [layer.register_forward_pre_hook(self._enter, with_kwargs=True),
                       layer.register_forward_hook(self._leave)]
        self._hooks += [module.register_forward_hook(self._linear(f"{path}.{name}"))
                        for name, module in layer.named_modules() if _is_linear(module)]

    def _enter(self, module, args, kwargs):
        if self.input is None:
            self.input = _first_tensor(list(args) + [kwargs.get("hidden_states")])
            self.entry = history(self.input)
            self.call = (args, kwargs)  # what the split check (auto_check) calls the layer with

    def _leave(self, module, args, output):
        if self.output is None:
            self.output = _first_tensor(output)
            self.exit = history(self.output)

    def _linear(self, name):
        def hook(module, args, output):
            if name not in self.linears:
                self.linears[name] = (_first_tensor(args), _first_tensor(output))
                self.made[name] = tuple(map(history, self.linears[name]))
        return hook

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()

    def decide(self) -> List[Dict[str, str]]:
        """The layer's split groups: each a writer, the readers feeding it and what lies between.
        What stays whole, and why in a line, is left in ``self.whole`` (names relative to the layer)."""
        self.whole: Dict[str, str] = {}
        if self.input is None or self.output is None or not self.linears:
            return []
        outputs = {id(out): name for name, (_, out) in self.made.items()
                   if out is not None and not isinstance(out, torch.Tensor)}
        entry = self.entry if not isinstance(self.entry, torch.Tensor) else None
        reaching_output = walk_back([self.exit], outputs, entry).reached  # last linears before the output
        seen, packed = {}, {}
        for name, (inp, _) in self.made.items():
            walk = walk_back([inp], outputs, entry)
            seen[name] = (walk.reached, walk.entry, walk.params)
            packed.update(_packed_outputs(walk.nodes, outputs))
        # Reads the residual stream: the layer input or earlier writers' outputs added to it, and (from
        # the second round on) maybe with outputs of linears kept whole, which every rank computes whole
        # (a hyper-connection's stream mix); rounds until what stays whole no longer changes.
        whole_outputs, rounds = set(reaching_output), []
        for _ in range(len(self.linears) + 1):
            rounds.append(self._round(seen, reaching_output, whole_outputs))
            split = set().union(*([w, *seen[w][0]] for w in rounds[-1][1] - set(rounds[-1][2])))
            if reaching_output | (set(self.linears) - split) == whole_outputs:
                break
            whole_outputs = reaching_output | (set(self.linears) - split)
        else:
            rounds.append(rounds[0])  # no fixed point: the residual stream alone
        readers, writers, unsafe, undecided = rounds[-1]
        self.whole.update({self._relative(n): why for n, why in undecided.items()})
        for w, why in unsafe.items():
            self.whole[self._relative(w)] = f"with its readers {', '.join(map(self._relative, sorted(seen[w][0])))}: {why}"
        groups: List[Dict[str, str]] = []
        params = {id(p): p for p in self._params}
        for w in sorted(writers - set(unsafe)):
            plan: Dict[str, str] = {}
            groups.append(plan)
            between = [params[i] for i in seen[w][2] if i in self.owners]
            widths = [self.linears[r][1].shape[-1] for r in seen[w][0]]
            if any(p.numel() in widths for p in between):
                # A norm over a projection's whole width (every head at once): the readers' outputs are
                # gathered and the writer splits its input, as transformers' OLMo 2 plan does.
                plan.update({r: "colwise_gather_output" for r in seen[w][0]})
                plan[w] = "rowwise_split_input"
                continue
            plan.update({r: PACKED_STYLES.get(packed.get(r, 1), "colwise") for r in seen[w][0]})
            plan[w] = "rowwise"
            # Parameters applied to head-split activations (per-head norms): each rank sees its heads.
            # A vector of one value per head (attention sinks) is split with the heads.
            per_head = [p for p in between if p.dim() == 1 and p.numel() in self.heads]
            plan.update({self.param_names[id(p)]: "colwise" for p in per_head})
            plan.update({self.owners[id(p)]: "replicated_with_grad_allreduce" for p in between
                         if not any(p is q for q in per_head)})
        feeding = set().union(*(seen[w][0] for w in writers)) if writers else set()
        self._name_lone_readers(readers - feeding - writers - set(undecided), seen, reaching_output)
        return groups

    def _name_lone_readers(self, lone, seen, reaching_output) -> None:
        """Why readers feeding no writer stay whole (recorded in ``self.whole``)."""
        for r in sorted(lone):
            read_by = sorted(n for n in seen if r in seen[n][0])
            self.whole[self._relative(r)] = (
                "writes back into the residual stream itself (no linear after it to split by rows)"
                if r in reaching_output else
                f"its output goes to {self._relative(read_by[0])}, which does not write back into the residual stream"
                if read_by else "feeds no linear writing back into the residual stream")

    def _relative(self, name: str) -> str:
        return name[len(self.path) + 1:]

    def _why_undecided(self, name, seen, readers, reaching_output, writers) -> str:
        """Why the rule cannot split ``name``, in a line (names relative to the layer)."""
        before = sorted(seen[name][0])
        if name in readers:  # a reader whose output feeds a writer and also the residual stream
            fed = next(w for w in sorted(writers) if name in seen[w][0])
            return f"its output goes two ways: into {self._relative(fed)} and back into the residual stream"
        inner = [b for b in before if b not in readers or b in reaching_output]
        if name not in reaching_output:
            source = next(iter(inner or before), None)
            return (f"sits between linears: reads {self._relative(source)}'s output, not the residual stream"
                    if source else "reads neither the residual stream nor another linear")
        if seen[name][1] and before:
            return "writes back into the residual stream from it and from other linears at once"
        if inner:
            return f"writes back into the residual stream from {self._relative(inner[0])}, which does not read it alone"
        return "writes back into the residual stream from no linear reading it"

    def _round(self, seen, reaching_output, whole_outputs):
        """(readers, writers, {writer: why its group stays whole}, {linear the rule cannot decide: why}) when
        readers are the linears reading the residual stream and else only ``whole_outputs``."""
        readers = {n for n, (before, from_input, _) in seen.items() if (from_input or before & reaching_output)
                   and before <= whole_outputs}
        writers = {n for n in reaching_output if seen[n][0] and not seen[n][1] and seen[n][0] <= readers - reaching_output}
        colwise = set().union(*(seen[w][0] for w in writers)) if writers else set()
        undecided = {n: self._why_undecided(n, seen, readers, reaching_output, writers)
                     for n in sorted((set(self.linears) - readers - reaching_output) | (colwise & reaching_output)
                                     | {n for n in reaching_output - writers if n not in readers})}
        return readers, writers, self._unsafe_writers(writers, seen, undecided), undecided

    def _unsafe_writers(self, writers, seen, undecided: Dict[str, str]) -> Dict[str, str]:
        """{writer: why its group must stay whole}: one of its readers is undecided, or a linear other
        than a writer reads a reader's output (split, it would see a shard), or the group shares a
        reader with such a group (a reader is split for all the writers it feeds, or none)."""
        unsafe: Dict[str, str] = {}
        for w in sorted(writers):
            inside = sorted(seen[w][0] & set(undecided))
            fed = sorted((n, r) for n in seen if n not in writers for r in seen[n][0] & seen[w][0])
            if inside:
                unsafe[w] = f"its reader {self._relative(inside[0])} stays whole"
            elif fed:
                linear, reader = map(self._relative, fed[0])
                unsafe[w] = (f"its reader {linear} reads its reader {reader}'s output (a linear between two others)"
                             if fed[0][0] in seen[w][0] else f"{linear} also reads its reader {reader}'s output")
        changed = True
        while changed:  # groups sharing a reader with one kept whole stay whole too
            changed = False
            for w in sorted(set(writers) - set(unsafe)):
                shared = next((v for v in sorted(unsafe) if seen[v][0] & seen[w][0]), None)
                if shared is not None:
                    unsafe[w], changed = f"shares a reader with {self._relative(shared)}, kept whole", True
        return unsafe
