"""Per-step figures of a PTD-P run: time, peak memory per rank and the pipeline's bubble."""
from __future__ import annotations

import resource
import sys
import time
from typing import List, Optional

import torch
import torch.distributed as dist

from torchpp.pipeline.trace import COMPUTE, parse_action


class StepTimer:
    """Wall time of a step, its tokens/s and its model FLOP utilisation.

    Args:
        tokens_per_step: tokens of one global batch.
        flops_per_token: model FLOPs per token (training_flops_per_token).
        peak_flops: the peak of all ranks together, FLOP/s (per-rank peak x world size).
    """

    def __init__(self, tokens_per_step: int, flops_per_token: float, peak_flops: float):
        self.tokens_per_step, self.flops_per_token, self.peak_flops = tokens_per_step, flops_per_token, peak_flops
        self._start = time.perf_counter()
        self.seconds = 0.0

    def start(self) -> None:
        self._start = time.perf_counter()

    def stop(self) -> float:
        self.seconds = time.perf_counter() - self._start
        return self.seconds

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.seconds

    @property
    def mfu(self) -> float:
        return self.tokens_per_s * self.flops_per_token / self.peak_flops


def peak_memory_bytes(device: torch.device, group=None) -> List[int]:
    """Every rank's peak memory so far (collective over `group`, default the world), in rank
    order: on an accelerator, the allocator's peak; on CPU, the process's peak resident set."""
    if device.type == "cpu":
        scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
        mine = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
    else:
        mine = torch.get_device_module(device.type).max_memory_allocated(device)
    peaks = torch.zeros(dist.get_world_size(group), dtype=torch.float64)
    peaks[dist.get_rank(group)] = mine
    dist.all_reduce(peaks, group=group)
    return [int(p) for p in peaks.tolist()]


def pipeline_bubble(sched, group: Optional[dist.ProcessGroup] = None) -> float:
    """The last step's bubble ratio over the pipeline group, as the zero-bubble paper measures
    it: (longest span - most busy time) / longest span, where a rank's span runs from the start
    of its first compute action to the end of its last. Collective over the pipeline group."""
    spans = [(start, end) for action, start, end, _ in sched.timeline() if parse_action(action)[1] in COMPUTE]
    if not spans:
        mine = torch.zeros(2, dtype=torch.float64)
    else:
        mine = torch.tensor([spans[-1][1] - spans[0][0], sum(end - start for start, end in spans)],
                            dtype=torch.float64)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=group if group is not None else sched.group)
    span, busy = mine.tolist()
    return (span - busy) / span if span > 0 else 0.0
