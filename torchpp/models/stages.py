"""Pipeline stages cut out of an existing model, each running the model's own modules.

A model is cut at its stack of layers (``PipelineLayout``: the stack's path, and the modules
before it, on the first stage, and after it, on the last). On each rank the layers of other
ranks' stages are replaced by placeholders, in place, so the model keeps its structure and its
parameter names.

A transformers model's stage runs the model's own forward (masks, rotary tables, position
embeddings, scaling, everything between its layers stays as transformers writes it): a
later stage calls it on the token ids, which travel down the pipeline with the hidden states
(layers may read them: hash routing, padding masks), the modules of earlier stages returning
zeros of their output's shape; the hidden states received from the previous stage enter at
the stage's first layer (a pre-hook swaps them in);
a stage before the last leaves at its last layer (a hook ends the forward there). Any other
model's stage calls its modules in sequence: the modules before the stack, the stage's
layers, the modules after it.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from torchpp.models.placeholders import Elsewhere, ElsewhereLayer, meta_copy


@dataclass
class PipelineLayout:
    """Where a model is cut into stages.

    Attributes:
        layers: dotted path of the nn.ModuleList of layers (``"model.layers"``).
        before: paths of the modules that run before the layers (first stage), in order.
        after: paths of the modules that run after them (last stage), in order.
        extras: for each layer returning a tuple, which of its outputs after the hidden states
            are tensors (True) or None (False), () for a 1-tuple: the next stage receives the
            tensors; empty (layers return their hidden states alone) unless traced
            (``torchpp.models.run_order``).
        layer_state: after each layer, what the layers leave in a mapping argument for later
            layers (transformers' ``shared_kv_states``): (the argument's name, ((key, number of
            tensors), ...)); the next stage receives those tensors and starts from them.
        shared: paths of the modules every stage runs (their parameters reach the layers'
            inputs other than the hidden states: ``torchpp.models.run_order``); kept on
            every pipeline rank, their gradients summed over the pipeline.
        reads: what the model's forward hands to a layer or a module after the stack, besides its
            hidden states, computed from earlier layers' outputs (Inkling 2's block states): {the
            layer's index, or the module's path: (the layer index it runs at, or the number of
            layers, the layer outputs read)} (``torchpp.models.carried_check``). A stage receives
            the output of the layer before its first; one of an earlier layer cannot reach it.
        reads_inside: {layer index: earlier layers whose computation it reads other than through
            its arguments (a tensor kept on a module between the calls: through autograd, or a
            module attribute, ``torchpp.models.module_state``)}: no stage may start between
            them (``torchpp.models.carried_check``). The key ``module_state.AFTER_STACK``: what
            the model reads after the stack (the last stage must hold those layers).
    """

    layers: str
    before: List[str]
    after: List[str]
    shared: List[str] = field(default_factory=list)
    extras: Dict[int, Tuple[bool, ...]] = field(default_factory=dict)
    layer_state: Dict[int, Tuple[str, Tuple[Tuple[str, int], ...]]] = field(default_factory=dict)
    reads: Dict[str, Tuple[int, Tuple[int, ...]]] = field(default_factory=dict)
    reads_inside: Dict[object, Tuple[int, ...]] = field(default_factory=dict)


def get_submodule(model: nn.Module, path: str) -> nn.Module:
    return model.get_submodule(path) if path else model


def set_submodule(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(get_submodule(model, parent), name, module)


class _Exit(Exception):
    """Ends a stage's forward after its last layer, carrying that layer's output (and the
    tensors the layers left for later layers: ``PipelineLayout.layer_state``)."""

    def __init__(self, output, state=()):
        super().__init__("pipeline stage exit")
        self.output, self.state = output, list(state)


def _hidden(output) -> torch.Tensor:
    return output[0] if isinstance(output, (tuple, list)) else output


class ModelStage(nn.Module):
    """One pipeline stage of a model cut in place (see the module docstring).

    The first stage takes what the model takes (a transformers model: ``input_ids`` and the
    keyword arguments ``attention_mask``, ``position_ids``); every stage but the last returns
    the hidden states leaving its last layer, with, for a transformers model, the position ids,
    token ids and attention mask behind them (integer tensors travel forward with the hidden
    states, so a later stage builds the same masks and rotary tables); the last returns what the model
    returns (its logits, for a causal LM). With ``router_load`` set (the MoE load-balancing
    loss, torchpp.expert_parallel.router_load), every stage's output ends with the router
    statistics so far, counts int64 [E + 1] and probability sums float32 [E], which the next
    stage takes from the end of its inputs (the last stage: (logits, counts, prob_sum)).

    Args:
        model: the whole model (this rank's part of it; not registered as a submodule, so the
            stage's parameters are its own).
        layout: where the model is cut.
        index: the model stage's index.
        layer_range: (first, end) of the stage's layers.
        first, last: whether the stage holds the modules before / after the layers.
        hf: run the model's own forward (a transformers model) rather than the modules in sequence.
    """

    def __init__(self, model: nn.Module, layout: PipelineLayout, index: int, layer_range: Tuple[int, int],
                 first: bool, last: bool, hf: bool):
        super().__init__()
        self.index, self.layer_range, self.first, self.last, self.hf = index, layer_range, first, last, hf
        object.__setattr__(self, "_model", model)  # not a submodule: only the stage's own parameters count
        self.layout = layout
        stack = get_submodule(model, layout.layers)
        self.layers = nn.ModuleList(stack[i] for i in range(*layer_range))
        self.before = nn.ModuleList(get_submodule(model, p) for p in layout.before) if first else None
        self.after = nn.ModuleList(get_submodule(model, p) for p in layout.after) if last else None
        self._incoming: Optional[torch.Tensor] = None
        self._incoming_state: Optional[Tuple[str, Dict[str, tuple]]] = None
        self._active = False
        # (number of experts, top-k) when the stages carry the router statistics of the MoE
        # load-balancing loss (set by parallelize), else None.
        self.router_load: Optional[Tuple[int, int]] = None
        # Layers of this rank's other stages are set aside while this stage runs the stack.
        self._others: Dict[int, nn.Module] = {}
        if hf:
            if not first:
                self.layers[0].register_forward_pre_hook(self._enter, with_kwargs=True)
            if not last:
                self.layers[-1].register_forward_hook(self._leave, with_kwargs=True)

    def _enter(self, module, args, kwargs):
        if not self._active:  # recomputation in backward, or the model called outside the pipeline
            return None
        incoming = self._incoming
        if self._incoming_state:  # what earlier layers left for later ones (shared key/value states)
            name, entries = self._incoming_state
            kwargs[name].update(entries)
        if args:
            return (incoming,) + tuple(args[1:]), kwargs
        return args, {**kwargs, "hidden_states": incoming}

    # Run eagerly after a compiled last layer: raised inside its graph, the exit made dynamo give up
    # the layer's frame, so that layer ran uncompiled.
    @torch.compiler.disable
    def _leave(self, module, args, kwargs, output):
        if self._active:
            state = self.layout.layer_state.get(self.layer_range[1] - 1)
            raise _Exit(output, [t for key, _ in state[1] for t in kwargs[state[0]][key]] if state else [])

    def set_aside(self, layers: Dict[int, nn.Module]) -> None:
        """The layers of this rank's other stages (indices in the stack), which must not run
        (on this stage's placeholder input) when this stage runs the model's forward."""
        self._others = dict(layers)

    @contextlib.contextmanager
    def _running(self, incoming: Optional[torch.Tensor], extras: Optional[tuple] = None, state=None):
        stack = get_submodule(self._model, self.layout.layers)
        for i in self._others:
            stack[i] = ElsewhereLayer(i, self._others[i], like=self._others[i])
        placeholders = [layer for layer in stack if isinstance(layer, ElsewhereLayer)]
        for layer in placeholders:  # the layers before ours hand on what the previous stage's last returned
            layer.extras = extras
        before_ours = stack[self.layer_range[0] - 1] if self.layer_range[0] > 0 else None
        if isinstance(before_ours, ElsewhereLayer):
            before_ours.received = incoming
        self._incoming, self._incoming_state, self._active = incoming, state, True
        try:
            yield
        finally:
            self._incoming, self._incoming_state, self._active = None, None, False
            for layer in placeholders:
                layer.extras = layer.received = None
            for i, layer in self._others.items():
                stack[i] = layer

    def _unpack(self, rest: Sequence[torch.Tensor]):
        """(the previous stage's last layer's extra outputs or None, position ids, token ids,
        attention mask or None, the layers' state for later layers or None) from what a later
        stage receives after the hidden states."""
        kinds = self.layout.extras.get(self.layer_range[0] - 1)
        received = list(rest[:sum(kinds)]) if kinds else []
        rest = rest[len(received):]
        # () for layers returning a 1-tuple: the placeholders return one too (the model indexes it).
        extras = tuple(received.pop(0) if is_tensor else None for is_tensor in kinds) if kinds is not None else None
        state = None
        described = self.layout.layer_state.get(self.layer_range[0] - 1)
        if described:
            name, entries = described
            tensors = list(rest[:sum(n for _, n in entries)])
            rest = rest[len(tensors):]
            state = (name, {key: tuple(tensors.pop(0) for _ in range(n)) for key, n in entries})
        return extras, rest[0], rest[1], (rest[2] if len(rest) > 2 else None), state

    def forward(self, x: torch.Tensor, *rest: torch.Tensor, **kwargs):
        if not self.hf:
            return self._sequential(x, *rest, **kwargs)
        if self.router_load is None:
            return self._hf_forward(x, *rest, **kwargs)
        # The MoE load-balancing loss: router statistics travel at the end of every stage's
        # output (torchpp.expert_parallel.router_load); the first stage starts from none.
        from torchpp.expert_parallel.router_load import accumulating, starting_load, RouterLoad

        num_experts, top_k = self.router_load
        if self.first:
            load = starting_load(num_experts, top_k, x.device)
            mask = kwargs.get("attention_mask")
        else:
            *rest, counts, prob_sum = rest
            load = RouterLoad(counts, prob_sum, top_k)
            mask = self._unpack(rest)[3]
        load.mask = _flat_token_mask(mask, x)
        # transformers' own aux loss of a stage's layers alone would be wrong and unused.
        with accumulating(load):
            output = self._hf_forward(x, *rest, output_router_logits=False, **kwargs)
        output = output if isinstance(output, tuple) else (output,)
        return output + (load.counts, load.prob_sum)

    def _hf_forward(self, x: torch.Tensor, *rest: torch.Tensor, **kwargs):
        model = self._model
        if self.first:
            position_ids = kwargs.pop("position_ids", None)
            attention_mask = kwargs.pop("attention_mask", None)
            # Without position ids every stage lets the model compute its own from the token ids
            # (Roberta's count from the padding index): a [b, 1] tensor of -1 travels instead.
            carried_positions = x.new_full((x.shape[0], 1), NO_POSITIONS) if position_ids is None else position_ids
            input_ids, incoming, extras, state = x, None, None, None
            call = dict(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask, **kwargs)
        else:
            extras, carried_positions, input_ids, attention_mask, state = self._unpack(rest)
            position_ids = None if _no_positions(carried_positions) else carried_positions
            # The model's own forward runs up to our first layer on the token ids (earlier
            # stages' modules give zeros), where the received hidden states are swapped in.
            call = dict(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask, **kwargs)
            incoming = x
        with self._running(incoming, extras, state):
            try:
                # nn.Module.__call__: the parallelized model's own __call__ refuses calls under a pipeline.
                output = nn.Module.__call__(model if self.last else _base_model(model), use_cache=False, **call)
            except _Exit as leaving:
                kinds = self.layout.extras.get(self.layer_range[1] - 1) or ()
                # The tensors the trace saw (a recurrent state, a tuple the model keeps only for its cache, is not).
                extras = [e for e, is_tensor in zip(leaving.output[1:], kinds) if is_tensor and e is not None]
                carried = (_hidden(leaving.output), *extras, *leaving.state,
                           carried_positions, input_ids)
                return carried if attention_mask is None else carried + (attention_mask,)
        return output.logits if hasattr(output, "logits") else output[0]

    def _sequential(self, x, *rest, **kwargs):
        if self.first:
            for module in self.before:
                x = module(x, *rest, **kwargs)
                rest, kwargs = (), {}
        for layer in self.layers:
            x = _hidden(layer(x, *rest, **kwargs))
            rest, kwargs = (), {}
        if self.last:
            for module in self.after:
                x = module(x)
        return x

    def extra_repr(self) -> str:
        return f"stage {self.index}: layers [{self.layer_range[0]}, {self.layer_range[1]})"


NO_POSITIONS = -1  # the value of the [b, 1] tensor that travels where no position ids were given


def _no_positions(position_ids: torch.Tensor) -> bool:
    return position_ids.dim() == 2 and position_ids.size(1) == 1 and bool((position_ids == NO_POSITIONS).all())


def _flat_token_mask(attention_mask: Optional[torch.Tensor], like: torch.Tensor) -> Optional[torch.Tensor]:
    """transformers' load-balancing loss counts the tokens of a 2D [batch, seq] attention mask
    (float32, flattened as the router's rows), or every token without one."""
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2:
        raise ValueError(f"torchpp: the MoE load-balancing loss counts tokens by a 2D [batch, seq] attention_mask, "
                         f"as transformers does; got one of shape {list(attention_mask.shape)}")
    return attention_mask.reshape(-1).to(device=like.device, dtype=torch.float32)


def _base_model(model: nn.Module) -> nn.Module:
    """A transformers model's base model (``model.model``, ``model.transformer``)."""
    return getattr(model, "base_model", model)


def _stand_in(model: nn.Module, path: str, before: bool) -> None:
    """Replaces the module at ``path`` by an ``Elsewhere``; a container (ModuleList, ModuleDict),
    which the model indexes rather than calls, keeps its place and each member is replaced."""
    module = get_submodule(model, path)
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        for name, _ in list(module.named_children()):
            _stand_in(model, f"{path}.{name}", before)
        return
    set_submodule(model, path, Elsewhere(path, before, module))


def cut_in_place(model: nn.Module, layout: PipelineLayout, bounds: Sequence[int], mine: Sequence[int],
                 hf: bool) -> Dict[int, ModelStage]:
    """Keeps this rank's stages of ``model`` and replaces the rest by placeholders, in place
    (the layout's shared modules stay on every rank).

    Args:
        model: the model (modified in place).
        layout: where it is cut.
        bounds: [0, first layer of stage 1, ..., number of layers].
        mine: the model stages this rank holds.
        hf: a transformers model (stages run its own forward).

    Returns:
        {model stage index: ModelStage} for this rank's stages.
    """
    num_stages = len(bounds) - 1
    stack = get_submodule(model, layout.layers)
    kept = {i for s in mine for i in range(bounds[s], bounds[s + 1])}
    for i in range(len(stack)):
        if i not in kept:
            stack[i] = ElsewhereLayer(i, stack[i], like=meta_copy(stack[i]))
    keep_before, keep_after = 0 in mine, num_stages - 1 in mine
    for paths, keep, before in ((layout.before, keep_before, True), (layout.after, keep_after, False)):
        if not keep:
            for path in paths:
                _stand_in(model, path, before)
    stages = {s: ModelStage(model, layout, s, (bounds[s], bounds[s + 1]), s == 0, s == num_stages - 1, hf)
              for s in mine}
    for s, stage in stages.items():
        stage.set_aside({i: stack[i] for t in mine if t != s for i in range(bounds[t], bounds[t + 1])})
    return stages
