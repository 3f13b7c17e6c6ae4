"""The end of a training step's backward: everything that must happen before optimizer.step()."""
from __future__ import annotations

from typing import Iterable, Optional

from torch import nn

from torchpp.parallel.data_parallel import GradReducer, OverlapStats
from torchpp.parallel.groups import ParallelState
from torchpp.tensor_parallel.utils import allreduce_sequence_parallel_grads, allreduce_tp_replica_grads


def finalize_grads(
    modules: Iterable[nn.Module], state: ParallelState, reducer: Optional[GradReducer] = None
) -> Optional[OverlapStats]:
    """Completes this rank's gradients for the step (Megatron's finalize_model_grads).

    Sums, over the TP group, the partial gradients of parameters replicated across TP ranks
    that saw different sequence slices (sequence parallelism) and over each group of TP ranks
    holding copies of one key/value head (``mark_tp_replicas``), then finishes the
    data-parallel reduction (buckets not yet launched are launched; all are awaited).
    With ZeRO-1, pass no reducer: the optimizer's step reduce-scatters instead.

    Args:
        modules: this rank's stage modules.
        state: the ParallelState from init_parallel.
        reducer: the GradReducer of this rank's parameters, if data parallel without ZeRO.

    Returns:
        The reducer's overlap statistics, or None.
    """
    if state.tp > 1:
        for module in modules:
            allreduce_sequence_parallel_grads(module, state.tp_group)
            allreduce_tp_replica_grads(module, state.tp_group)
    return reducer.finish() if reducer is not None else None
