"""Which layer outputs a model's forward hands, besides the hidden states, to later layers and
to the modules after the stack (read from one traced forward; pp > 1), and whether a cut lets
every stage have them.

A later pipeline stage receives the hidden states entering its first layer, the output of the
layer before it (and what ``PipelineLayout.extras`` and ``layer_state`` describe); it reruns
the model's forward up to that layer on placeholders, the one before its first layer returning
what it received. A tensor the forward itself builds from an earlier layer's output (Inkling
2's block states: the hidden states at each block boundary, concatenated) would be built there
from placeholders, and its gradient would never reach the layer that computed it: such a cut is
refused instead of training on wrong gradients. So is a tensor a layer computes and a later
layer reads without it passing through their arguments (kept on a module or closure between the
calls): the nodes of the traced autograd graph are numbered as they are made, so a walk back
from a layer's output, stopped at its arguments, tells which earlier layers' computation it
reaches.
"""
from __future__ import annotations

from bisect import bisect_right
from typing import Dict, List, Optional, Sequence, Set, Tuple

import torch

from torchpp.models.autograd_walk import tensors_in, walk_back
from torchpp.tensor_parallel.styles import PlanError


class CarriedAcrossLayers:
    """What one traced forward handed to each layer and end module besides the hidden states,
    filled by ``torchpp.models.run_order``'s hooks."""

    def __init__(self) -> None:
        self.outputs: Dict[int, object] = {}  # layer index -> grad_fn of its hidden output
        self.handed_on: Set[object] = set()  # grad_fns of what the stages carry (a layer's extra outputs)
        self.side: Dict[int, List[torch.Tensor]] = {}  # layer index -> its inputs other than the hidden states
        self.module_inputs: Dict[str, List[torch.Tensor]] = {}  # end module path -> its inputs
        self.spans: Dict[int, List[int]] = {}  # layer index -> [first, last] number of the nodes made in its call
        self.arguments: Dict[int, List[object]] = {}  # layer index -> what made its arguments (autograd nodes)
        self.results: Dict[int, List[object]] = {}  # layer index -> what made its outputs

    def enter(self, index: int, args, kwargs) -> None:
        """At a layer's first call: what made its arguments, and the number its nodes start after."""
        clock = _autograd_clock()
        if index in self.spans or clock is None:
            return
        self.spans[index] = [clock + 1, clock + 1]
        self.arguments[index] = [t.grad_fn for t in tensors_in(list(args) + [kwargs]) if t.grad_fn is not None]

    def leave(self, index: int, output) -> None:
        clock = _autograd_clock()
        if index not in self.spans or index in self.results or clock is None:
            return
        self.spans[index][1] = clock
        self.results[index] = [t.grad_fn for t in tensors_in(output) if t.grad_fn is not None]

    def reads_inside(self) -> Dict[int, Tuple[int, ...]]:
        """{layer: earlier layers whose computation its output reaches other than through its
        arguments} (``PipelineLayout.reads_inside``)."""
        found: Dict[int, Set[int]] = {}
        layers = sorted(self.results)
        for j in layers:
            start = self.spans[j][0]
            blocked = set(self.arguments[j])
            pending, seen = list(self.results[j]), set()  # nodes, not ids (autograd_walk's docstring)
            while pending:
                node = pending.pop()
                if node in seen or node in blocked:
                    continue
                seen.add(node)
                number = node._sequence_nr()
                if number < start:  # made before this layer ran: inside an earlier one, or between
                    inside = next((i for i in layers if i < j and self.spans[i][0] <= number <= self.spans[i][1]), None)
                    if inside is not None:
                        found.setdefault(j, set()).add(inside)
                        continue
                    if number < self.spans[layers[0]][0]:  # before the stack: nothing to find there
                        continue
                pending.extend(n for n, _ in node.next_functions if n is not None)
        return {j: tuple(sorted(earlier)) for j, earlier in found.items()}

    def reads(self, after: Sequence[str]) -> Dict[str, Tuple[int, Tuple[int, ...]]]:
        """{reader: (where it runs: its layer index, or the number of layers for a module after the
        stack, the layer outputs it reads besides its hidden states)} (``PipelineLayout.reads``).

        Args:
            after: paths of the modules that run after the stack (the last stage).
        """
        named = {fn: str(i) for i, fn in self.outputs.items() if fn is not None}
        end = max(self.outputs, default=-1) + 1
        # Left out: the output a reader takes anyway (a layer's input, an end module's last layer output).
        readers = [(str(j), tensors, j) for j, tensors in sorted(self.side.items())]
        readers += [(path, self.module_inputs.get(path, []), end) for path in after]
        found = {}
        for reader, tensors, at in readers:
            walk = walk_back([t for t in tensors if t.is_floating_point()], named=named, blocked=self.handed_on)
            earlier = tuple(sorted(int(i) for i in walk.reached if int(i) < at - 1))
            if earlier:
                found[reader] = (at, earlier)
        return found


def check_cut(stack: str, reads: Dict[str, Tuple[int, Tuple[int, ...]]], bounds: Sequence[int],
              reads_inside: Dict[int, Tuple[int, ...]] = None) -> None:
    """Raises PlanError where a stage reads the output of a layer of an earlier stage other than
    the last one before its own first layer (which it receives: the hidden states), or anything
    computed inside a layer of an earlier stage that the layers' arguments do not carry.

    Args:
        stack: path of the stack of layers.
        reads: ``PipelineLayout.reads``.
        bounds: [0, first layer of stage 1, ..., number of layers].
        reads_inside: ``PipelineLayout.reads_inside`` (a reader named by a string runs after the stack).
    """
    for reader, layers in (reads_inside or {}).items():
        at = bounds[-1] - 1 if isinstance(reader, str) else reader  # after the stack: on the last stage
        first = bounds[bisect_right(bounds, at) - 1]
        unreachable = [i for i in layers if i < first]
        if unreachable:
            name = reader if isinstance(reader, str) else f"{stack}.{reader}"
            raise PlanError(f"torchpp.parallelize: {name} reads a tensor computed inside {stack}."
                            f"{unreachable[0]} that the model keeps between the calls itself, not as a layer's argument "
                            f"or output (on a module, say): the stage starting at {stack}.{first} never computes it, "
                            f"so its value and gradient would be wrong; choose split= so that no stage starts between "
                            f"them, or use pp=1")
    for reader, (at, outputs) in reads.items():
        first = bounds[bisect_right(bounds, min(at, bounds[-1] - 1)) - 1]
        unreachable = [i for i in outputs if i < first - 1]
        if unreachable:
            name = f"{stack}.{reader}" if reader.isdigit() else reader
            raise PlanError(f"torchpp.parallelize: {name} reads a tensor the model's forward computes from the "
                            f"output of {stack}.{unreachable[0]} and carries between its layers itself (besides the "
                            f"hidden states the pipeline passes from stage to stage): the stage starting at "
                            f"{stack}.{first} would compute it from placeholders and its gradient would not reach "
                            f"{stack}.{unreachable[0]}; choose split= so that no stage starts between them, or use pp=1")


def other_inputs(values: list) -> List[torch.Tensor]:
    """The tensors among a layer's arguments besides its hidden states, mappings left out (masks
    by kind, and the layers' own state, which ``layer_state`` carries)."""
    found: List[torch.Tensor] = []
    for value in values:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (tuple, list)):
            found.extend(v for v in value if isinstance(v, torch.Tensor))
    return found


def _autograd_clock() -> Optional[int]:
    """The number of the autograd node made last (nodes are numbered as they are made, per
    thread); None with autograd off."""
    probe = torch.zeros((), requires_grad=True).view(())
    return None if probe.grad_fn is None else probe.grad_fn._sequence_nr()
