"""Splitting a step's arguments into microbatches, merging the outputs back, and the loss
weights that make the summed microbatch gradients equal the full-batch gradient.

The chunk specs are torch.distributed.pipelining.microbatch's, by the same names, so code that
chunks along another dimension migrates by changing imports: ``TensorChunkSpec(dim)`` splits
(or merges) a tensor along ``dim``, ``_Replicate`` gives every microbatch the whole value,
``_CustomReducer`` / ``sum_reducer`` fold the microbatches' outputs. torch's own spec objects
are accepted too.
"""
from __future__ import annotations

import operator
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch.distributed.pipelining import microbatch as _torch_microbatch
from torch.utils._pytree import tree_flatten, tree_unflatten

DEFAULT_CHUNK_DIM = 0


class TensorChunkSpec:
    """Split a tensor argument (or merge an output) along ``split_dim``."""

    def __init__(self, split_dim: int):
        self.split_dim = split_dim

    def __repr__(self) -> str:
        return f"TensorChunkSpec({self.split_dim})"

    def __eq__(self, other) -> bool:
        return isinstance(other, _TENSOR_SPECS) and other.split_dim == self.split_dim

    def __hash__(self) -> int:
        return hash(("TensorChunkSpec", self.split_dim))

    @staticmethod
    def from_tuple(chunk_dims: Tuple[int, ...]) -> Tuple["TensorChunkSpec", ...]:
        """One spec per positional argument: ``from_tuple((0, 1))`` splits the first along dim 0,
        the second along dim 1."""
        return tuple(TensorChunkSpec(d) for d in chunk_dims)

    @staticmethod
    def from_dict(chunk_dims: Dict[str, int]) -> Dict[str, "TensorChunkSpec"]:
        """One spec per keyword argument: ``from_dict({"ids": 0, "mask": 1})``."""
        return {k: TensorChunkSpec(d) for k, d in chunk_dims.items()}


class _Replicate:
    """Every microbatch gets the whole value (the default for anything but a tensor)."""

    def __repr__(self) -> str:
        return "_Replicate()"


class _CustomReducer:
    """Merges an output by folding its microbatches: ``reduce_fn(...reduce_fn(init_value, out_0)..., out_m-1)``."""

    def __init__(self, init_value, reduce_fn):
        self.init_value = init_value
        self.reduce_fn = reduce_fn


sum_reducer = _CustomReducer(torch.tensor(0.0), operator.add)

# torch's spec classes mean the same: a migrated program may still build them from torch's module.
_TENSOR_SPECS = (TensorChunkSpec, _torch_microbatch.TensorChunkSpec)
_REPLICATE_SPECS = (_Replicate, _torch_microbatch._Replicate)
_REDUCERS = (_CustomReducer, _torch_microbatch._CustomReducer)


def split_microbatches(batch: Optional[torch.Tensor], num_microbatches: int,
                       dim: int = DEFAULT_CHUNK_DIM) -> Optional[List[torch.Tensor]]:
    """Splits along ``dim`` into ``num_microbatches`` parts whose sizes differ by at most one.

    Args:
        batch: the step's tensor (None passes through).
        num_microbatches: number of parts.
        dim: the dimension to split.
    """
    if batch is None:
        return None
    if not isinstance(batch, torch.Tensor):
        raise TypeError(f"torchpp pipeline: step inputs must be tensors, got {type(batch).__name__}")
    if not -batch.dim() <= dim < batch.dim() or batch.size(dim) < num_microbatches:
        raise ValueError(
            f"torchpp pipeline: a batch of shape {tuple(batch.shape)} cannot be split into "
            f"{num_microbatches} microbatches along dim {dim}"
        )
    return list(torch.tensor_split(batch, num_microbatches, dim=dim))


def _default_spec(value) -> Any:
    return TensorChunkSpec(DEFAULT_CHUNK_DIM) if isinstance(value, torch.Tensor) else _Replicate()


def _split_flat(values: Sequence[Any], specs: Sequence[Any], chunks: int, where: str) -> List[List[Any]]:
    """Per microbatch, the flat leaves ``values`` split or replicated by their ``specs``."""
    columns = []
    for i, (value, spec) in enumerate(zip(values, specs)):
        if isinstance(spec, _REPLICATE_SPECS) or spec in _REPLICATE_SPECS:  # torch accepts the class too
            columns.append([value] * chunks)
        elif isinstance(spec, _TENSOR_SPECS):
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"torchpp pipeline: {where} leaf {i} has chunk spec {spec!r} but is a "
                                f"{type(value).__name__}, not a tensor")
            columns.append(split_microbatches(value, chunks, spec.split_dim))
        else:
            raise TypeError(f"torchpp pipeline: {where} leaf {i} has chunk spec {spec!r}; expected a "
                            "TensorChunkSpec or _Replicate")
    return [[column[k] for column in columns] for k in range(chunks)]


def _split_tree(tree, spec_tree, chunks: int, where: str) -> List[Any]:
    values, structure = tree_flatten(tree)
    if spec_tree is None:
        specs = [_default_spec(v) for v in values]
    else:
        specs = tree_flatten(spec_tree)[0]  # torch's from_dict gives an fx immutable_dict: compare leaves
        if len(specs) != len(values):
            raise ValueError(f"torchpp pipeline: {where} chunk spec {spec_tree!r} has {len(specs)} leaves but the "
                             f"{where} have {len(values)}: {structure}")
    return [tree_unflatten(leaves, structure) for leaves in _split_flat(values, specs, chunks, where)]


def split_args_kwargs_into_chunks(
    args: Tuple[Any, ...],
    kwargs: Optional[Dict[str, Any]],
    chunks: int,
    args_chunk_spec: Optional[Tuple[Any, ...]] = None,
    kwargs_chunk_spec: Optional[Dict[str, Any]] = None,
) -> Tuple[List[Tuple[Any, ...]], List[Dict[str, Any]]]:
    """The step's positional and keyword arguments, per microbatch (torch's function).

    Args:
        args, kwargs: the step's arguments, any nesting of tuples, lists and dicts.
        chunks: number of microbatches; a tensor too small to split into them raises.
        args_chunk_spec, kwargs_chunk_spec: a spec per leaf, in the arguments' structure
            (``TensorChunkSpec(dim)`` or ``_Replicate()``). None: tensors split along dim 0,
            anything else replicated.

    Returns:
        ``(args_split, kwargs_split)``: ``chunks`` tuples and ``chunks`` dicts.
    """
    args_split = _split_tree(tuple(args), None if args_chunk_spec is None else tuple(args_chunk_spec), chunks,
                             "positional arguments")
    kwargs_split = _split_tree(dict(kwargs or {}), kwargs_chunk_spec, chunks, "keyword arguments")
    return args_split, kwargs_split


def merge_chunks(chunks: List[Any], chunk_spec) -> Any:
    """The microbatches' outputs merged into the batch's (torch's function).

    Args:
        chunks: one output per microbatch, each of the same structure.
        chunk_spec: a spec per leaf in that structure: ``TensorChunkSpec(dim)`` concatenates
            along ``dim``, a ``_CustomReducer`` folds, anything else must be equal in every
            microbatch and is kept once. None: every leaf concatenated along dim 0.
    """
    flat0, structure = tree_flatten(chunks[0])
    if chunk_spec is None:
        specs = [TensorChunkSpec(DEFAULT_CHUNK_DIM)] * len(flat0)
    else:
        specs = tree_flatten(chunk_spec)[0]
        if len(specs) != len(flat0):
            raise ValueError(f"torchpp pipeline: output_merge_spec {chunk_spec!r} has {len(specs)} leaves but the "
                             f"stage output has {len(flat0)}: {structure}")
    flat = [tree_flatten(chunk)[0] for chunk in chunks]
    merged = []
    for i, spec in enumerate(specs):
        column = [leaves[i] for leaves in flat]
        if isinstance(spec, _TENSOR_SPECS):
            merged.append(torch.cat(column, dim=spec.split_dim))
        elif isinstance(spec, _REDUCERS):
            value = spec.init_value
            for part in column:
                value = spec.reduce_fn(value, part)
            merged.append(value)
        else:
            if any(part is not column[0] and not _equal(part, column[0]) for part in column[1:]):
                raise ValueError(f"torchpp pipeline: output leaf {i} has merge spec {spec!r} but differs "
                                 "between microbatches")
            merged.append(column[0])
    return tree_unflatten(merged, structure)


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return torch.equal(a, b)
    return a == b


def chunk_dim_of(spec) -> Optional[int]:
    """The dimension a spec splits along, or None (replicated)."""
    return spec.split_dim if isinstance(spec, _TENSOR_SPECS) else None


def loss_weights(microbatches: List[torch.Tensor], dim: int = DEFAULT_CHUNK_DIM) -> List[float]:
    """Each microbatch's share of the batch (its size along ``dim``): a mean loss times its
    share sums to the batch mean."""
    total = sum(mb.size(dim) for mb in microbatches)
    return [mb.size(dim) / total for mb in microbatches]
