"""DualPipe's twin stages: rank r and rank p-1-r hold copies of the same two model stages,
whose gradients are summed after each step."""
from __future__ import annotations

import datetime
import time
from typing import Dict, List

import torch
import torch.distributed as dist

from torchpp.pipeline.errors import PipelineTimeoutError
from torchpp.tensor_parallel.utils import combine_flat_grads

# Tag of the gradient exchange between DualPipe's twin stages, far above the executor's tags.
TWIN_GRAD_TAG = 1 << 30


def flag_twin_parameters(sched) -> List[torch.nn.Parameter]:
    """DualPipe: every parameter's gradient is summed with its twin's after backward
    (``grad_summed_after_backward``: data parallelism waits for it), and the gradient norm
    counts each parameter on the rank of its pipeline-0 copy (``shared_duplicate`` elsewhere;
    a parameter shared by two stages belongs to the earlier one). Returns the parameters
    once each, in model-stage order (the same order on the twin rank)."""
    unique: Dict[int, torch.nn.Parameter] = {}
    for st in sorted(sched.stages, key=lambda s: s.stage_index):
        owned = sched.schedule.stage_to_rank[st.stage_index] == sched.rank  # pipeline 0's stage k is stage k
        for param in st.submod.parameters():
            if id(param) not in unique:
                unique[id(param)] = param
                param.grad_summed_after_backward = True
                if not owned:
                    param.shared_duplicate = True
    return list(unique.values())

def sum_twin_gradients(sched) -> None:
    """DualPipe: rank r and rank p-1-r both hold model stages r and p-1-r; add up their grads."""
    peer = dist.get_global_rank(sched.group, sched.schedule.num_ranks - 1 - sched.rank)

    # Bounded where the wait blocks the host, as the executor's (zero: the group's own timeout).
    bounded = sched.timeout > 0 and sched.device.type == "cpu"
    bound = datetime.timedelta(seconds=sched.timeout if bounded else 0)

    def add_twins(flat: torch.Tensor) -> torch.Tensor:
        theirs = torch.empty_like(flat)
        ops = [dist.P2POp(dist.isend, flat, peer, sched.group, TWIN_GRAD_TAG),
               dist.P2POp(dist.irecv, theirs, peer, sched.group, TWIN_GRAD_TAG)]
        start = time.monotonic()
        try:
            for work in dist.batch_isend_irecv(ops):
                work.wait(bound)
        except RuntimeError as error:
            waited = time.monotonic() - start
            if not bounded or waited < sched.timeout:
                raise
            raise PipelineTimeoutError(
                f"torchpp pipeline: rank {sched.rank} waited {waited:.1f} s for the gradients of its DualPipe "
                f"twin (rank {sched.schedule.num_ranks - 1 - sched.rank}), the pipeline timeout: the peer is "
                f"stopped, hung, or slower than the limit allows") from error
        return flat.add_(theirs)

    combine_flat_grads(sched._twin_params, add_twins)
