"""Tensor-parallel layers (Megatron-LM) with optional sequence parallelism."""
from torchpp.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from torchpp.tensor_parallel.embedding import VocabParallelEmbedding
from torchpp.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from torchpp.tensor_parallel.random import (
    RNGStatesTracker,
    get_rng_tracker,
    model_parallel_manual_seed,
)
from torchpp.tensor_parallel.utils import (
    allreduce_sequence_parallel_grads,
    allreduce_tp_replica_grads,
    divide,
    mark_sequence_parallel,
    mark_tp_replicas,
    sequence_parallel_params,
    share_summed_grads,
    tp_replica_params,
)

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "vocab_parallel_cross_entropy",
    "RNGStatesTracker",
    "get_rng_tracker",
    "model_parallel_manual_seed",
    "allreduce_sequence_parallel_grads",
    "mark_sequence_parallel",
    "mark_tp_replicas",
    "allreduce_tp_replica_grads",
    "tp_replica_params",
    "sequence_parallel_params",
    "share_summed_grads",
    "divide",
]
