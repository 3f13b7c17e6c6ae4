"""What plan="auto" reads from one traced forward of a layer (``torchpp.models.auto_plan``'s
module docstring has the rule): hooks on the layer and its linears record what made each input
and output, and ``LayerTrace.decide`` turns the autograd graph between them into split groups
and the reasons the rest stays whole."""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from torchpp.models.autograd_walk import first_tensor, history, walk_back
from torchpp.tensor_parallel.expert_linears import is_expert_linear


# A reader whose output is split into equal parts along its features (fused q, k, v; fused gate
# and up) is split part by part.
PACKED_STYLES = {2: "packed_colwise", 3: "packed3_colwise"}
# Styles that keep a module whole (replicated) in a group: not counted as split.
WHOLE_STYLES = ("replicated_with_grad_allreduce", "replicated_copy_output")


def is_linear(module: nn.Module) -> bool:
    """nn.Linear, transformers' Conv1D (GPT-2's linears, weight [in, out]; also once a TP class is swapped in),
    or experts' linears in one 3-D weight (``torchpp.tensor_parallel.expert_linears``: JetMoE's)."""
    return isinstance(module, nn.Linear) or (any(c.__name__ == "Conv1D" for c in type(module).__mro__) and
                                             getattr(module, "weight", None) is not None and
                                             module.weight.dim() == 2) or is_expert_linear(module)


def _packed_outputs(nodes, outputs: Dict[object, str]) -> Dict[str, int]:
    """{linear: number of equal parts} for linears whose output a split along the last dimension
    cuts into equal parts (the nodes of a walk that met them)."""
    found: Dict[str, int] = {}
    for node in nodes:
        kind = type(node).__name__
        if not kind.startswith("Split"):
            continue
        sources = [outputs.get(n) for n, _ in node.next_functions if n is not None]
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


class LayerTrace:
    """Hooks on one layer and its linears; the decision from what they saw (auto_plan's module docstring)."""

    def __init__(self, layer: nn.Module, path: str, heads=()):
        self.path, self.heads = path, set(heads)
        self.layer, self.call = layer, None
        self.untracked = False  # run with autograd off (inside a custom autograd function): no graph to read
        self.input: Optional[torch.Tensor] = None
        self.output: Optional[torch.Tensor] = None
        self.linears: Dict[str, Tuple[torch.Tensor, torch.Tensor]] = {}
        # What made the layer's input and output and each linear's, recorded as they ran (autograd_walk.history).
        self.entry = self.exit = None
        self.made: Dict[str, Tuple[object, object]] = {}
        self.owners: Dict[int, str] = {}  # id of a parameter -> the module holding it (not a linear)
        self._params = [p for name, m in layer.named_modules() if name and not is_linear(m)
                        for p in m.parameters(recurse=False)]
        self.param_names = {id(p): f"{path}.{name}" for name, p in layer.named_parameters()}
        for name, module in layer.named_modules():
            if not is_linear(module):  # the layer itself too: parameters held by the attention block directly
                self.owners.update({id(p): f"{path}.{name}".rstrip(".") for p in module.parameters(recurse=False)})
        self._hooks = [layer.register_forward_pre_hook(self._enter, with_kwargs=True),
                       layer.register_forward_hook(self._leave)]
        self._hooks += [module.register_forward_hook(self._linear(f"{path}.{name}"))
                        for name, module in layer.named_modules() if is_linear(module)]
        # What the modules holding linears (an attention block) are called with: a bias built for every
        # head outside them (ALiBi) is cut to each rank's heads (auto_check tries it).
        self.calls: Dict[str, tuple] = {}
        self._hooks += [module.register_forward_pre_hook(self._called(name), with_kwargs=True)
                        for name, module in layer.named_modules() if name and not is_linear(module)
                        and any(is_linear(m) for m in module.modules())]

    def _enter(self, module, args, kwargs):
        if self.input is None:
            self.input = first_tensor(list(args) + [kwargs.get("hidden_states")])
            self.entry = history(self.input)
            self.call = (args, kwargs)  # what the split check (auto_check) calls the layer with
            self.untracked = not torch.is_grad_enabled()

    def _leave(self, module, args, output):
        if self.output is None:
            self.output = first_tensor(output)
            self.exit = history(self.output)

    def _called(self, name):
        def hook(module, args, kwargs):
            self.calls.setdefault(name, (args, kwargs))
        return hook

    def _linear(self, name):
        def hook(module, args, output):
            if name not in self.linears:
                self.linears[name] = (first_tensor(args), first_tensor(output))
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
        outputs = {out: name for name, (_, out) in self.made.items()
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
            latents = rounds[-1][4]
            split = set().union(*([w, *seen[w][0] - latents] for w in rounds[-1][1] - set(rounds[-1][2])))
            if reaching_output | (set(self.linears) - split) == whole_outputs:
                break
            whole_outputs = reaching_output | (set(self.linears) - split)
        else:
            rounds.append(rounds[0])  # no fixed point: the residual stream alone
        readers, writers, unsafe, undecided, latents = rounds[-1]
        self.whole.update({self._relative(n): why for n, why in undecided.items()})
        for w, why in unsafe.items():
            self.whole[self._relative(w)] = f"with its readers {', '.join(map(self._relative, sorted(seen[w][0])))}: {why}"
        groups: List[Dict[str, str]] = []
        params = {id(p): p for p in self._params}
        for w in sorted(writers - set(unsafe)):
            plan: Dict[str, str] = {}
            groups.append(plan)
            group = seen[w][0] - latents
            between = [params[i] for i in seen[w][2] if i in self.owners]
            widths = [self.linears[r][1].shape[-1] for r in group]
            if any(p.numel() in widths for p in between):
                # A norm over a projection's whole width (every head at once): the readers' outputs are
                # gathered and the writer splits its input, as transformers' OLMo 2 plan does.
                plan.update({r: "colwise_gather_output" for r in group})
                plan[w] = "rowwise_split_input"
                continue
            plan.update({r: PACKED_STYLES.get(packed.get(r, 1), "colwise") for r in group})
            plan[w] = "rowwise"
            self._copy_latents_into_region(plan, seen[w][0] & latents, group, seen, params)
            # Parameters applied to head-split activations (per-head norms): each rank sees its heads.
            # A vector of one value per head (attention sinks) is split with the heads.
            per_head = [p for p in between if p.dim() == 1 and p.numel() in self.heads]
            plan.update({self.param_names[id(p)]: "colwise" for p in per_head})
            plan.update({self.owners[id(p)]: "replicated_with_grad_allreduce" for p in between
                         if not any(p is q for q in per_head)})
        feeding = set().union(*(seen[w][0] for w in writers)) if writers else set()
        self._name_lone_readers(readers - feeding - writers - set(undecided), seen, reaching_output, readers)
        for n in sorted(latents):
            up = sorted(self._relative(m) for m in seen if seen[m][0] == {n} and not seen[m][1]
                        and m not in reaching_output)
            self.whole.setdefault(self._relative(n), (
                f"a low-rank projection ({self._width(n)} features, the stream {self.input.shape[-1]}) that "
                f"{' and '.join(up)} widen{'s' if len(up) == 1 else ''} back up: computed whole on every rank"))
        return groups

    def _copy_latents_into_region(self, plan: Dict[str, str], direct, group, seen, params) -> None:
        """Where a low-rank projection's output also reaches the writer directly (MLA's rotary key,
        shared by every head), its linear ends in one f of its own (``replicated_copy_output``) and
        the readers taking it back up have none (``colwise_after_copy``): parameters between them
        (the latent's norm) then see partial gradients, summed over TP."""
        for latent in sorted(direct):
            plan[latent] = "replicated_copy_output"
            for reader in sorted(r for r in group if latent in seen[r][0]):
                plan[reader] = "colwise_after_copy"
                plan.update({self.owners[i]: "replicated_with_grad_allreduce" for i in seen[reader][2]
                             if i in self.owners and i in params})

    def _name_lone_readers(self, lone, seen, reaching_output, readers) -> None:
        """Why readers feeding no writer stay whole (recorded in ``self.whole``)."""
        for r in sorted(lone):
            read_by = sorted(n for n in seen if r in seen[n][0])
            self.whole[self._relative(r)] = (
                "writes back into the residual stream itself (no linear after it to split by rows)"
                if r in reaching_output else
                f"its output mixes into the stream {self._relative(read_by[0])} reads, which needs it whole"
                if read_by and read_by[0] in readers and seen[read_by[0]][1] else
                f"its output goes to {self._relative(read_by[0])}, which does not write back into the residual stream"
                if read_by else "feeds no linear writing back into the residual stream")

    def _width(self, name: str) -> int:
        """A linear's output features."""
        return self.linears[name][1].shape[-1]

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
        """(readers, writers, {writer: why its group stays whole}, {linear the rule cannot decide: why},
        latents) when readers are the linears reading the residual stream and else only ``whole_outputs``.

        A *latent* is a low-rank projection of whole inputs that a linear reading nothing else
        widens back up for further linears (MLA's q_a and kv_a, a LoRA adapter's A, a
        hyper-connection's mix_down): it stays whole, as Megatron keeps MLA's down projections, and
        what reads it reads a whole tensor, so that linear may be a group's reader (MLA's q_b and
        kv_b, the adapter's B). Where the latent also reaches the writer directly (MLA's rotary key),
        ``decide`` moves the group's f onto the latent's output.

        A writer's output is whole on every rank (its all-reduce), so it may feed readers of its own
        even where it does not write back into the stream: a block without residual adds (Zamba's
        shared transformer: attention, then its MLP on o_proj's output, then a projection) splits
        group by group. Such an *inner* writer's output must reach only linears reading whole
        tensors (a linear mixing it with a split reader's output keeps it whole), and its readers'
        outputs together must be no narrower than its own and than the stream: a low-rank pair
        (MLA's q_a -> q_b, a LoRA adapter) would all-reduce q_b's heads to save a sliver of compute
        and leave the attention after it whole; a router's or a hyper-connection's small inner MLP
        would pay two collectives for less. Stream writers keep the rule above, as before.
        Inner writers are found to a fixed point."""
        inner: set = set()
        stream = self.input.shape[-1]
        for _ in range(len(self.linears) + 1):
            full = reaching_output | inner
            whole = whole_outputs | inner
            latents = {n for n, (before, from_input, _) in seen.items() if n not in reaching_output
                       and (from_input or before & full) and before <= whole
                       and any(seen[m][0] == {n} and not seen[m][1] and self._width(m) > self._width(n)
                               and m not in reaching_output for m in seen)}
            readers = {n for n, (before, from_input, _) in seen.items() if n not in latents
                       and (from_input or before & (full | latents)) and before <= whole | latents}
            fed = {n: before - latents for n, (before, _, _) in seen.items()}  # a writer's readers: not latents
            pairs = {n for n in set(self.linears) - reaching_output
                     if fed[n] and not seen[n][1] and fed[n] <= readers - reaching_output
                     and sum(map(self._width, fed[n])) >= max(self._width(n), stream)}
            found = {w for w in pairs if all(seen[n][0] <= whole_outputs | pairs | latents
                                             for n in seen if w in seen[n][0])}
            if found == inner:
                break
            inner = found
        writers = {n for n in reaching_output if fed[n] and not seen[n][1] and fed[n] <= readers - reaching_output}
        writers |= inner
        colwise = set().union(*(fed[w] for w in writers)) if writers else set()
        undecided = {n: self._why_undecided(n, seen, readers, reaching_output, writers)
                     for n in sorted((set(self.linears) - readers - reaching_output - writers - latents)
                                     | (colwise & reaching_output)
                                     | {n for n in reaching_output - writers if n not in readers})}
        return readers, writers, self._unsafe_writers(writers, seen, undecided, latents), undecided, latents

    def _unsafe_writers(self, writers, seen, undecided: Dict[str, str], latents) -> Dict[str, str]:
        """{writer: why its group must stay whole}: one of its readers is undecided, or a linear other
        than a writer reads a reader's output (split, it would see a shard), or a latent reaching
        the writer directly feeds a linear outside the group (its f would sum that one's gradient
        twice), or the group shares a reader with such a group (a reader is split for all the
        writers it feeds, or none)."""
        unsafe: Dict[str, str] = {}
        for w in sorted(writers):
            group = seen[w][0] - latents
            inside = sorted(group & set(undecided))
            fed = sorted((n, r) for n in seen if n not in writers for r in seen[n][0] & group)
            direct = sorted((n, latent) for latent in seen[w][0] & latents for n in seen
                            if latent in seen[n][0] and n != w
                            and (n not in group or seen[n][0] != {latent} or seen[n][1]))
            if inside:
                unsafe[w] = f"its reader {self._relative(inside[0])} stays whole"
            elif fed:
                linear, reader = map(self._relative, fed[0])
                unsafe[w] = (f"its reader {linear} reads its reader {reader}'s output (a linear between two others)"
                             if fed[0][0] in group else f"{linear} also reads its reader {reader}'s output")
            elif direct:
                linear, latent = map(self._relative, direct[0])
                unsafe[w] = (f"{latent} reaches it directly and also feeds {linear}, not a reader of its group "
                             f"reading {latent} alone")
        changed = True
        while changed:  # groups sharing a reader with one kept whole stay whole too
            changed = False
            for w in sorted(set(writers) - set(unsafe)):
                shared = next((v for v in sorted(unsafe) if (seen[v][0] & seen[w][0]) - latents), None)
                if shared is not None:
                    unsafe[w], changed = f"shares a reader with {self._relative(shared)}, kept whole", True
        return unsafe
