"""Interleaved timing for the bench scripts: every variant runs once per round, in turn, so the
machine's drift and noise hit all of them alike; reported as median and spread."""
from __future__ import annotations

import statistics
import time
from typing import Callable, Dict, Hashable, Iterable, List, Tuple

import torch.distributed as dist


def interleaved(step: Callable[[Hashable], None], variants: Iterable[Hashable], repeats: int,
                warmup: int = 2) -> Dict[Hashable, List[float]]:
    """Seconds of ``step(variant)`` for each variant, ``repeats`` rounds after ``warmup``; every
    rank starts each run together (a barrier before it)."""
    variants = list(variants)
    for _ in range(warmup):
        for variant in variants:
            step(variant)
    samples: Dict[Hashable, List[float]] = {variant: [] for variant in variants}
    for _ in range(repeats):
        for variant in variants:
            dist.barrier()
            start = time.perf_counter()
            step(variant)
            samples[variant].append(time.perf_counter() - start)
    return samples


def median_spread(times: List[float]) -> Tuple[float, float]:
    """(median, (max - min) / median)."""
    median = statistics.median(times)
    return median, (max(times) - min(times)) / median
