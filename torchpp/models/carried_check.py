"""Whether a model's forward carries, between its layers, a tensor computed from a layer's output
other than the hidden states (read from one traced forward; pp > 1).

A later pipeline stage receives only the hidden states entering its first layer (and what
``PipelineLayout.extras`` and ``layer_state`` describe); it reruns the model's forward up to that
layer on placeholders. A tensor the forward itself builds from earlier layers' outputs and hands
to a later layer or end module (Inkling 2's block states: the hidden states at each block
boundary, concatenated) would then be built from placeholders there, and its gradient would
never reach the layers that computed it: the cut is refused instead of training on wrong
gradients.
"""
from __future__ import annotations

from typing import Dict, List, Sequence, Set

import torch

from torchpp.models.autograd_walk import walk_back
from torchpp.tensor_parallel.styles import PlanError


class CarriedAcrossLayers:
    """What one traced forward handed to each layer and end module besides the hidden states,
    filled by ``torchpp.models.run_order``'s hooks."""

    def __init__(self) -> None:
        self.outputs: Dict[int, object] = {}  # layer index -> grad_fn of its hidden output
        self.handed_on: Set[object] = set()  # grad_fns of what the stages carry (a layer's extra outputs)
        self.side: Dict[int, List[torch.Tensor]] = {}  # layer index -> its inputs other than the hidden states
        self.module_inputs: Dict[str, List[torch.Tensor]] = {}  # end module path -> its inputs

    def refuse(self, stack: str, after: Sequence[str]) -> None:
        """Raises PlanError naming the first layer (or module after the stack) whose inputs other
        than the hidden states are computed from an earlier layer's output.

        Args:
            stack: path of the stack of layers.
            after: paths of the modules that run after it (the last stage).
        """
        named = {id(fn): str(i) for i, fn in self.outputs.items() if fn is not None}
        last = max(self.outputs, default=-1)
        # A layer may read no earlier layer's output but as its hidden states; a module after the stack, the last one's.
        readers = [(f"{stack}.{j}", tensors, j) for j, tensors in sorted(self.side.items())]
        readers += [(path, self.module_inputs.get(path, []), last) for path in after]
        for reader, tensors, limit in readers:
            walk = walk_back([t for t in tensors if t.is_floating_point()], named=named, blocked=self.handed_on)
            earlier = sorted(int(i) for i in walk.reached if int(i) < limit)
            if earlier:
                raise PlanError(f"torchpp.parallelize: {reader} reads a tensor the model's forward computes from the "
                                f"output of {stack}.{earlier[0]} and carries between its layers itself (besides the "
                                f"hidden states the pipeline passes from stage to stage): a stage after that layer "
                                f"would compute it from placeholders and its gradient would not reach "
                                f"{stack}.{earlier[0]}; use pp=1")


def other_inputs(args: tuple, kwargs: dict) -> List[torch.Tensor]:
    """The tensors a layer gets besides its hidden states (its first argument), mappings left out
    (masks by kind, and the layers' own state, which ``layer_state`` carries)."""
    values = list(args[1:]) + [v for k, v in kwargs.items() if k != "hidden_states"]
    found: List[torch.Tensor] = []
    for value in values:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (tuple, list)):
            found.extend(v for v in value if isinstance(v, torch.Tensor))
    return found
