"""The planner's vocabulary: the cluster, the training run, a layout and a ranked candidate."""
from __future__ import annotations

from typing import Optional

from dataclasses import dataclass, field

from torchpp.plan.memory import RECOMPUTE, ZERO_STAGES
from torchpp.plan.model_config import ModelConfig


class PlanError(ValueError):
    """No layout can run the request; the message names the numbers."""


@dataclass(frozen=True)
class Cluster:
    """GPUs and links. Bandwidths are all-reduce bus bandwidths per GPU, in bytes/s."""

    num_gpus: int
    gpu_memory: float  # bytes
    gpus_per_node: int = 8
    intra_node_bandwidth: float = 250e9  # NVLink (A100 nccl-tests bus bandwidth)
    inter_node_bandwidth: float = 25e9  # one 200 Gb/s InfiniBand NIC per GPU
    peak_flops: float = 312e12  # A100 bf16 dense
    efficiency: float = 0.5  # achieved fraction of peak on transformer GEMMs (Megatron: 44-52%)


@dataclass(frozen=True)
class Training:
    global_batch: int
    seq_len: int
    element_bytes: int = 2  # 16-bit activations, weights and gradients
    micro_batches: tuple[int, ...] = (1, 2, 4, 8)
    schedules: tuple[tuple[str, int], ...] = (
        ("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("interleaved-1f1b", 4), ("zb-h1", 1), ("zb-v", 2),
        ("interleaved-zb", 2), ("interleaved-zb", 4), ("v-half", 2), ("v-min", 2))
    recompute: tuple[str, ...] = RECOMPUTE
    zero: tuple[int, ...] = ZERO_STAGES  # ZeRO stages to try when dp x cp > 1
    # cp sizes to try (each dividing s into 2c chunks); None: 1, 2, 4, 8 while each rank keeps at
    # least MIN_CP_SHARD tokens (shorter shards leave the ring's transfers too little compute to hide behind).
    context_parallel: tuple[int, ...] | None = None
    sequence_parallel: bool = True  # Megatron-3 SP with every TP > 1 (False: Megatron-2's feature set)
    # Model state per parameter (SPEC section 4): 16-bit weights and grads, fp32 master + Adam m, v.
    weight_bytes: float = 2
    grad_bytes: float = 2
    optimizer_bytes: float = 12  # what ZeRO-1 shards (ZeRO-2 adds the gradients, ZeRO-3 the weights)
    # Megatron-2 waits for each stage-boundary exchange (batch_isend_irecv + wait) before computing
    # on: the transfer adds to the stage's time. False: the simulator overlaps it (torchpp's runtime).
    blocking_p2p: bool = False

    @classmethod
    def megatron2(cls, global_batch: int, seq_len: int) -> "Training":
        """The PTD-P paper's (arXiv 2104.04473) feature set: no sequence parallelism, no ZeRO,
        full recompute, 1F1B and interleaved 1F1B, and Megatron's fp16 optimizer: fp16 weights
        and grads (2 + 2), fp32 master weights, Adam m and v and an fp32 copy of the grads
        (4 x 4): 20 bytes per parameter (Megatron-core's distributed-optimizer table)."""
        return cls(global_batch, seq_len, schedules=(("1f1b", 1), ("interleaved-1f1b", 2), ("interleaved-1f1b", 4)),
                   recompute=("full",), zero=(0,), context_parallel=(1,), sequence_parallel=False,
                   optimizer_bytes=16,
                   blocking_p2p=True)


MIN_CP_SHARD = 4096


def context_parallel_sizes(training: Training) -> tuple[int, ...]:
    if training.context_parallel is not None:
        return training.context_parallel
    return tuple(c for c in (1, 2, 4, 8) if c == 1 or training.seq_len // c >= MIN_CP_SHARD)


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    micro_batch: int
    num_microbatches: int
    chunks: int
    schedule: str
    recompute: str
    zero: int  # ZeRO stage over dp x cp
    cp: int = 1
    cp_mode: str = "ring"  # or "all-to-all", "all-to-all+ring" (parallelize's cp_mode)
    cp_all_to_all_size: Optional[int] = None  # "all-to-all+ring"'s groups (parallelize's cp_all_to_all_size)

    @property
    def zero1(self) -> bool:
        """The optimizer state is sharded (ZeRO stage 1 or more)."""
        return self.zero >= 1


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    step_time: float
    bubble_ratio: float
    memory_per_gpu: float  # the fullest rank
    breakdown: dict = field(hash=False, compare=False)  # seconds per step by cause

    @property
    def sort_key(self):
        return (self.step_time, self.memory_per_gpu)


@dataclass
class Plan:
    model: ModelConfig
    cluster: Cluster
    training: Training
    ranked: list[Candidate]
    rejected: dict[str, int]  # reason -> candidates

    @property
    def best(self) -> Candidate:
        return self.ranked[0]


def describe(layout: Layout) -> str:
    modes = {"ring": "", "all-to-all": " all-to-all",
             "all-to-all+ring": f" all-to-all({layout.cp_all_to_all_size})+ring"}
    cp = f" cp={layout.cp}{modes[layout.cp_mode]}" if layout.cp > 1 else ""
    return (f"tp={layout.tp} pp={layout.pp}{cp} dp={layout.dp} "
            f"b={layout.micro_batch} {layout.schedule}"
            f"{f' v={layout.chunks}' if layout.chunks > 1 else ''} recompute={layout.recompute}"
            f"{f' zero{layout.zero}' if layout.zero else ''}")
