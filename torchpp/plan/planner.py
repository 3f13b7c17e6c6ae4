"""Planner: enumerate (tp, pp, cp, dp, microbatch, v, schedule, recompute, ZeRO stage), drop
what does not fit in memory, rank the rest by simulated step time (torchpp.plan.cost_model).

Layouts number in the tens of thousands at cluster scale and a long schedule takes a while to
simulate, so the ranking is a branch and bound (torchpp.plan.search): a lower bound on each
layout's step time and memory, checked before any simulation, lets all but the leaders fall
away; the leaders are ranked exactly.
"""
from __future__ import annotations

from typing import Optional

from torchpp.plan.cost_model import evaluate
from torchpp.plan.layout import (MIN_CP_SHARD, Candidate, Cluster, Layout, Plan, PlanError, Training,
                                 context_parallel_sizes, describe)
from torchpp.plan.model_config import ModelConfig
from torchpp.plan.search import search

__all__ = ["Candidate", "Cluster", "Layout", "MIN_CP_SHARD", "Plan", "PlanError", "Training", "evaluate", "plan"]

# How many of the best layouts plan() ranks exactly by default.
KEEP = 10


def plan(model: ModelConfig, cluster: Cluster, training: Training, keep: int | None = KEEP) -> Plan:
    """Ranks the layouts that fit, best first; raises ``PlanError`` when none does.

    Args:
        model: the transformer's shape.
        cluster: GPUs, memory and links.
        training: global batch, sequence length, and the microbatch sizes and schedules to try.
        keep: rank (at least) this many of the best layouts exactly and let the others fall away
            by their lower bounds; None ranks every layout that fits (slow at cluster scale).
    """
    _check_possible(model, cluster, training)
    layouts = list(_layouts(model, cluster, training))
    rejected: dict[str, int] = {}
    ranked, smallest = search(model, cluster, training, layouts, keep, rejected)
    if not ranked and keep is not None:  # nothing fits: the exhaustive pass names the closest miss
        rejected = {}
        ranked, smallest = search(model, cluster, training, layouts, None, rejected)
    if not ranked:
        detail = ""
        if smallest is not None:
            detail = (f"; the least memory any layout needs is {smallest.memory_per_gpu / 1e9:.1f} GB per GPU "
                      f"({describe(smallest.layout)}) > {cluster.gpu_memory / 1e9:.1f} GB")
        raise PlanError(f"no layout of {model.name} fits on {cluster.num_gpus} GPUs{detail}")
    return Plan(model, cluster, training, ranked, rejected)


def _check_possible(model: ModelConfig, cluster: Cluster, training: Training) -> None:
    total = cluster.num_gpus * cluster.gpu_memory
    # However it is sharded, every weight, gradient and optimizer state must live somewhere.
    per_parameter = training.weight_bytes + training.grad_bytes + training.optimizer_bytes
    if model.num_parameters * per_parameter > total:
        raise PlanError(
            f"{model.name} has {model.num_parameters / 1e9:.1f}B parameters needing "
            f"{model.num_parameters * per_parameter / 1e9:.0f} GB for weights, gradients and Adam state "
            f"({per_parameter:g} bytes each), more than all memory: {cluster.num_gpus} GPUs x "
            f"{cluster.gpu_memory / 1e9:.0f} GB = {total / 1e9:.0f} GB")
    if training.global_batch < 1 or training.seq_len < 1:
        raise PlanError(f"global batch ({training.global_batch}) and sequence length ({training.seq_len}) must be >= 1")


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _layouts(model: ModelConfig, cluster: Cluster, training: Training):
    kv_heads = model.kv_heads or model.heads
    for tp in _divisors(cluster.num_gpus):
        if model.heads % tp or (kv_heads % tp and tp % kv_heads):
            continue
        for pp in _divisors(cluster.num_gpus // tp):
            for cp in context_parallel_sizes(training):
                if (cluster.num_gpus // (tp * pp)) % cp or (cp > 1 and training.seq_len % (2 * cp)):
                    continue  # zigzag: 2c equal chunks per sequence
                yield from _batch_layouts(model, cluster, training, tp, pp, cp)


def _batch_layouts(model: ModelConfig, cluster: Cluster, training: Training, tp: int, pp: int, cp: int):
    dp = cluster.num_gpus // (tp * pp * cp)
    if pp > model.num_layers or training.global_batch % dp:
        return
    for b in training.micro_batches:
        if (training.global_batch // dp) % b:
            continue
        m = training.global_batch // (dp * b)
        schedules = [("none", 1)] if pp == 1 else training.schedules
        for schedule, v in schedules:
            if model.num_layers % (pp * v):
                continue
            for recompute in training.recompute:
                for zero in (training.zero if dp * cp > 1 else (0,)):
                    for cp_mode, size in _cp_modes(model, cluster, tp, cp):
                        yield Layout(tp, pp, dp, b, m, v, schedule, recompute, zero, cp, cp_mode, size)


def _cp_modes(model: ModelConfig, cluster: Cluster, tp: int, cp: int) -> list[tuple[str, Optional[int]]]:
    """(mode, all-to-all group size): the ring always; all-to-all where cp divides a tensor-parallel
    rank's query heads; where cp spans nodes, all-to-all inside each node's cp ranks (a = its GPUs
    / tp, with the default rank order tp-cp-dp-pp) and the ring across nodes, where a divides them."""
    if cp == 1:
        return [("ring", None)]
    modes = [("ring", None)]
    local_heads = model.heads // tp
    if local_heads % cp == 0:
        modes.append(("all-to-all", None))
    a = cluster.gpus_per_node // tp if cluster.gpus_per_node % tp == 0 else 0
    if 1 < a < cp and cp % a == 0 and local_heads % a == 0:
        modes.append(("all-to-all+ring", a))
    return modes
