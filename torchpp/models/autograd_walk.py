"""One walk back through autograd graphs, shared by what reads a model's structure from a traced
forward (``run_order``, ``split_checks``, ``auto_plan``).

Autograd nodes are told apart by the Python objects themselves, held in the walk's containers,
never by ``id()`` alone: torch 2.11 frees a node's Python wrapper once nothing holds it, and the
next wrapper (another node's) may take its address (a column linear's output and the row
linear's after it read as one node, which left every row-split projection whole)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, List, Mapping, Optional, Set

import torch


def first_tensor(value) -> Optional[torch.Tensor]:
    """The first tensor in a module's arguments or output (tuples, lists, dicts and transformers'
    ModelOutput searched in order)."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        return next((t for t in map(first_tensor, value) if t is not None), None)
    if isinstance(value, dict):
        return first_tensor(list(value.values()))
    return None


def tensors_in(value) -> List[torch.Tensor]:
    """Every tensor in ``value``, through tuples, lists and mappings (a layers' state mapping included)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in tensors_in(v)]
    if isinstance(value, Mapping):
        return tensors_in(list(value.values()))
    return []


@dataclass
class Walk:
    """What a walk back from some tensors met.

    Attributes:
        reached: names of the named stops reached (the walk does not go past them).
        params: ids of the leaf tensors (parameters) met.
        entry: whether the entry node was reached (the walk does not go past it either).
        nodes: every node visited, for callers that read the operations on the way.
    """

    reached: Set[str] = field(default_factory=set)
    params: Set[int] = field(default_factory=set)
    entry: bool = False
    nodes: List[object] = field(default_factory=list)


def walk_back(tensors: Iterable[Optional[torch.Tensor]], named: Mapping[object, str] = None, entry=None,
              blocked: Iterable[object] = ()) -> Walk:
    """Walks back from ``tensors``' grad_fns.

    Args:
        tensors: where to start (None entries and tensors without history are skipped, a leaf
            that requires grad counts as a parameter met); an autograd node starts there itself.
        named: node -> name: nodes to record and not go past (linears' outputs).
        entry: a node to record and not go past (a layer's input).
        blocked: nodes not to go past, unrecorded (the layers' outputs).
    """
    named = named or {}
    blocked = set(blocked)
    walk = Walk()
    pending = []
    for tensor in tensors:
        if tensor is None:
            continue
        if not isinstance(tensor, torch.Tensor):  # a node recorded before in-place ops replaced its tensor's
            pending.append(tensor)
        elif tensor.grad_fn is not None:
            pending.append(tensor.grad_fn)
        elif tensor.requires_grad:
            walk.params.add(id(tensor))
    seen: Set[object] = set()  # the nodes themselves: alive, so no other node's wrapper takes their ids
    while pending:
        node = pending.pop()
        if node in seen or node in blocked:
            continue
        seen.add(node)
        if node in named:
            walk.reached.add(named[node])
            continue
        if entry is not None and node is entry:
            walk.entry = True
            continue
        walk.nodes.append(node)
        variable = getattr(node, "variable", None)
        if variable is not None:
            walk.params.add(id(variable))
        pending.extend(n for n, _ in node.next_functions if n is not None)
    return walk


def history(tensor: Optional[torch.Tensor]):
    """What made ``tensor`` now (its grad_fn, or itself if a leaf): a later in-place op on it (Falcon's
    ``mlp_output += attention_output``) gives the tensor a new grad_fn, not this one."""
    return None if tensor is None else (tensor.grad_fn if tensor.grad_fn is not None else tensor)
