"""Whether a pipeline can enter a model's stack of layers at a layer (plan="auto", pp > 1).

A later stage swaps the hidden states it receives into its first layer's input. That is all the
stage needs only if each layer's input is computed from the previous layer's output alone. A
model whose forward adds around its layers (XLM: ``tensor = tensor + attentions[i](tensor)``,
its layers spread over parallel ModuleLists) computes the next layer's input from this layer's
input too, which the stage never receives: the cut would give wrong gradients, so it is refused;
so is a stack whose layers run several times in one forward (Dory's recurrent loops).
"""
from __future__ import annotations

from typing import Dict, List

import torch
from torch import nn

from torchpp.models.autograd_walk import first_tensor, tensors_in, walk_back
from torchpp.models.stages import get_submodule
from torchpp.models.traced_forward import traced_forward
from torchpp.tensor_parallel.styles import PlanError


def check_layers_chain(model: nn.Module, stack: str) -> None:
    """Raises PlanError naming the first layer whose input is computed from the previous layer's
    input other than through that layer's outputs (one traced forward on a few tokens).

    Args:
        model: the unwrapped transformers model (unchanged).
        stack: path of its stack of layers.
    """
    layers = list(get_submodule(model, stack))
    inputs: Dict[int, torch.Tensor] = {}
    calls: Dict[int, int] = {}
    outputs: Dict[int, List[torch.Tensor]] = {}
    hooks = []
    for i, layer in enumerate(layers):
        def enter(module, args, kwargs, i=i):
            calls[i] = calls.get(i, 0) + 1
            inputs.setdefault(i, first_tensor(list(args) + [kwargs.get("hidden_states")]))

        def leave(module, args, output, i=i):
            outputs.setdefault(i, tensors_in(output))
        hooks += [layer.register_forward_pre_hook(enter, with_kwargs=True), layer.register_forward_hook(leave)]
    try:
        traced_forward(model)
    except Exception:  # noqa: BLE001 - a model that cannot run here is not judged
        return
    finally:
        for hook in hooks:
            hook.remove()
    looped = next((i for i, n in sorted(calls.items()) if n > 1), None)
    if looped is not None:
        raise PlanError(f"torchpp.parallelize(plan='auto'): {stack}.{looped} runs {calls[looped]} times in one forward "
                        f"(the model loops over its layers): a pipeline stage runs each of its layers once; pass "
                        f"plan= with a 'pp' part, or use pp=1")
    for i in range(len(layers) - 1):
        here, after = inputs.get(i), inputs.get(i + 1)
        if here is None or after is None or here.grad_fn is None:
            continue
        walk = walk_back([after], entry=here.grad_fn, blocked=[t.grad_fn for t in outputs.get(i, []) if t.grad_fn])
        if walk.entry:
            raise PlanError(f"torchpp.parallelize(plan='auto'): the input of {stack}.{i + 1} is computed from "
                            f"the input of {stack}.{i} besides its output (the model adds around its layers, or "
                            f"spreads them over parallel lists): a pipeline stage cannot start at one of them; pass "
                            f"plan= with a 'pp' part naming the layers, or use pp=1")
