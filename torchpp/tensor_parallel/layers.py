"""Megatron's column- and row-parallel linear layers over torch.ops.torchpp mappings.

ColumnParallelLinear splits the weight's output features over the TP group (each rank
computes a slice of the output); RowParallelLinear splits its input features (each rank
computes a partial sum, reduced over the group). Column then row is Megatron's MLP/attention
pattern: one all-reduce forward, one backward. With sequence_parallel, the all-reduces become
an all-gather before the column layer and a reduce-scatter after the row layer.
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from torchpp import ops
from torchpp.pipeline.split_linear import split_bw_linear
from torchpp.tensor_parallel.utils import check_same_device, divide, mark_tensor_parallel

InitMethod = Callable[[torch.Tensor], object]


def default_linear_init(weight: torch.Tensor) -> None:
    """nn.Linear's initialisation, so a parallel layer matches a freshly built nn.Linear."""
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))


def _linear(input, weight, bias, split_bw: bool) -> torch.Tensor:
    # The split B/W op defers the weight gradient to a pipeline's W pass; F.linear does not.
    if split_bw:
        return split_bw_linear(input, weight, bias)  # eager under torch.compile, so W stays deferred
    return F.linear(input, weight, bias)


def _full_then_shard(shape, dim, rank, size, init_method, dtype, device) -> torch.Tensor:
    # Initialise the whole matrix with the (TP-identical) default RNG and keep our shard, so the
    # parallel model equals the same model built in one process with the same seed.
    full = torch.empty(shape, dtype=dtype, device=device)
    init_method(full)
    return full.chunk(size, dim=dim)[rank].clone()


class ColumnParallelLinear(nn.Module):
    """y = x A^T + b with A split by rows (output features) over the TP group.

    Args:
        in_features: input features (full, every rank sees the whole input).
        out_features: output features of the whole layer; divided by the TP size.
        bias: add a bias (split like the output).
        gather_output: all-gather the output so every rank returns the full y; otherwise
            each rank returns its slice (the input a RowParallelLinear expects).
        sequence_parallel: the input is this rank's slice of the sequence; it is
            all-gathered along ``sequence_dim`` first (and reduce-scattered backward).
        sequence_dim: the sequence dimension of the input (0 for Megatron's [s, b, h]).
        group: the TP ProcessGroup, its name, or None for the default group.
        init_method: initialises the full weight (default: nn.Linear's).
        split_bw: use the split B/W linear, so a zero-bubble pipeline schedule can run this
            layer's weight gradient later (its W pass) than its input gradient.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        sequence_dim: int = 0,
        group: ops.GroupLike = None,
        init_method: Optional[InitMethod] = None,
        device=None,
        dtype=None,
        split_bw: bool = False,
    ):
        super().__init__()
        self.split_bw = split_bw
        if gather_output and sequence_parallel:
            raise ValueError("torchpp.ColumnParallelLinear: gather_output and sequence_parallel exclude each other")
        self.group = ops.group_of(group)
        self.tp_size = self.group.size()
        self.tp_rank = dist.get_rank(self.group)
        self.in_features = in_features
        self.out_features = out_features
        self.out_features_per_rank = divide(out_features, self.tp_size, "ColumnParallelLinear out_features")
        self.gather_output = gather_output
        self.sequence_parallel = sequence_parallel
        self.sequence_dim = sequence_dim
        weight = _full_then_shard(
            (out_features, in_features), 0, self.tp_rank, self.tp_size, init_method or default_linear_init, dtype, device
        )
        self.weight = nn.Parameter(weight)
        mark_tensor_parallel(self.weight, partition_dim=0, group_size=self.tp_size)
        if bias:
            bound = 1 / math.sqrt(in_features) if in_features > 0 else 0
            full_bias = torch.empty(out_features, dtype=weight.dtype, device=weight.device).uniform_(-bound, bound)
            self.bias = nn.Parameter(full_bias.chunk(self.tp_size)[self.tp_rank].clone())
            mark_tensor_parallel(self.bias, partition_dim=0, group_size=self.tp_size)
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_linear(cls, linear: nn.Linear, **kwargs) -> "ColumnParallelLinear":
        """Shards an existing nn.Linear (its rows) over the TP group, keeping its values."""
        layer = cls(
            linear.in_features, linear.out_features, bias=linear.bias is not None,
            init_method=nn.init.zeros_, device=linear.weight.device, dtype=linear.weight.dtype, **kwargs,
        )
        with torch.no_grad():
            layer.weight.copy_(linear.weight.chunk(layer.tp_size, dim=0)[layer.tp_rank])
            if linear.bias is not None:
                layer.bias.copy_(linear.bias.chunk(layer.tp_size)[layer.tp_rank])
        return layer

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        check_same_device(input, self.weight, "ColumnParallelLinear")
        if self.sequence_parallel:
            input = ops.gather_from_sp_region(input, self.group, dim=self.sequence_dim)
        else:
            input = ops.copy_to_tp_region(input, self.group)
        output = _linear(input, self.weight, self.bias, self.split_bw)
        if self.gather_output:
            output = ops.gather_from_tp_region(output, self.group, dim=-1)
        return output

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features} "
            f"({self.out_features_per_rank} per rank), tp={self.tp_size}, gather_output={self.gather_output}, "
            f"sequence_parallel={self.sequence_parallel}"
        )


class RowParallelLinear(nn.Module):
    """y = x A^T + b with A split by columns (input features) over the TP group.

    Args:
        in_features: input features of the whole layer; divided by the TP size.
        out_features: output features (full on every rank).
        bias: add a bias (replicated; added once, after the reduction).
        input_is_parallel: the input is already this rank's slice of the features (as a
            ColumnParallelLinear without gather_output returns); otherwise it is split here.
        sequence_parallel: reduce-scatter the output along ``sequence_dim`` instead of
            all-reducing it; the bias is then flagged ``sequence_parallel`` (see
            ``allreduce_sequence_parallel_grads``).
        sequence_dim: the sequence dimension of the output.
        group: the TP ProcessGroup, its name, or None for the default group.
        init_method: initialises the full weight (default: nn.Linear's).
        split_bw: use the split B/W linear (see ColumnParallelLinear).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        input_is_parallel: bool = False,
        sequence_parallel: bool = False,
        sequence_dim: int = 0,
        group: ops.GroupLike = None,
        init_method: Optional[InitMethod] = None,
        device=None,
        dtype=None,
        split_bw: bool = False,
    ):
        super().__init__()
        self.split_bw = split_bw
        if sequence_parallel and not input_is_parallel:
            raise ValueError("torchpp.RowParallelLinear: sequence_parallel needs input_is_parallel=True")
        self.group = ops.group_of(group)
        self.tp_size = self.group.size()
        self.tp_rank = dist.get_rank(self.group)
        self.in_features = in_features
        self.out_features = out_features
        self.in_features_per_rank = divide(in_features, self.tp_size, "RowParallelLinear in_features")
        self.input_is_parallel = input_is_parallel
        self.sequence_parallel = sequence_parallel
        self.sequence_dim = sequence_dim
        weight = _full_then_shard(
            (out_features, in_features), 1, self.tp_rank, self.tp_size, init_method or default_linear_init, dtype, device
        )
        self.weight = nn.Parameter(weight)
        mark_tensor_parallel(self.weight, partition_dim=1, group_size=self.tp_size)
        if bias:
            bound = 1 / math.sqrt(in_features) if in_features > 0 else 0
            self.bias = nn.Parameter(torch.empty(out_features, dtype=weight.dtype, device=weight.device).uniform_(-bound, bound))
            self.bias.sequence_parallel = sequence_parallel
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_linear(cls, linear: nn.Linear, **kwargs) -> "RowParallelLinear":
        """Shards an existing nn.Linear (its columns) over the TP group, keeping its values."""
        layer = cls(
            linear.in_features, linear.out_features, bias=linear.bias is not None,
            init_method=nn.init.zeros_, device=linear.weight.device, dtype=linear.weight.dtype, **kwargs,
        )
        with torch.no_grad():
            layer.weight.copy_(linear.weight.chunk(layer.tp_size, dim=1)[layer.tp_rank])
            if linear.bias is not None:
                layer.bias.copy_(linear.bias)
        return layer

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        check_same_device(input, self.weight, "RowParallelLinear")
        if not self.input_is_parallel:
            input = ops.scatter_to_tp_region(input, self.group, dim=-1)
        partial = _linear(input, self.weight, None, self.split_bw)
        if self.sequence_parallel:
            output = ops.reduce_scatter_to_sp_region(partial, self.group, dim=self.sequence_dim)
        else:
            output = ops.reduce_from_tp_region(partial, self.group)
        if self.bias is not None:
            output = output + self.bias
        return output

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features} ({self.in_features_per_rank} per rank), "
            f"out_features={self.out_features}, tp={self.tp_size}, input_is_parallel={self.input_is_parallel}, "
            f"sequence_parallel={self.sequence_parallel}"
        )
