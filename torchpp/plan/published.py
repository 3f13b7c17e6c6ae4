"""Layouts published with their results, for checking the planner against them.

PTD-P (Narayanan et al. 2021, arXiv 2104.04473), Table 1: GPT models at sequence length 2048
and vocabulary 51200 on A100-80GB, with the tensor- and pipeline-parallel sizes the paper ran.
"""
from __future__ import annotations

from dataclasses import dataclass

from torchpp.plan.cost_model import evaluate
from torchpp.plan.layout import Candidate, Cluster, Training
from torchpp.plan.model_config import ModelConfig
from torchpp.plan.planner import _layouts


@dataclass(frozen=True)
class PublishedLayout:
    billions: float  # the paper's parameter count
    model: ModelConfig
    tp: int
    pp: int
    gpus: int
    global_batch: int
    tflops_per_gpu: float  # achieved, as the paper reports

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)


def _row(billions, heads, hidden, layers, tp, pp, gpus, batch, tflops):
    model = ModelConfig(f"ptdp-{billions:g}b", num_layers=layers, hidden=hidden, heads=heads, vocab=51200)
    return PublishedLayout(billions, model, tp, pp, gpus, batch, tflops)


PTDP_WEAK_SCALING = (
    _row(1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    _row(3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    _row(7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    _row(18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    _row(39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    _row(76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    _row(145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    _row(310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    _row(529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    _row(1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
)


def best_with(model: ModelConfig, cluster: Cluster, training: Training, tp: int, pp: int) -> Candidate | None:
    """The fastest layout the planner models with tensor- and pipeline-parallel sizes (tp, pp),
    over its microbatch sizes, schedules, recompute and ZeRO choices; None if none fits."""
    best = None
    for layout in _layouts(model, cluster, training):
        if (layout.tp, layout.pp) != (tp, pp):
            continue
        try:
            cand = evaluate(model, cluster, training, layout)
        except ValueError:  # the schedule cannot serve (p, m, v)
            continue
        if cand.memory_per_gpu <= cluster.gpu_memory and (best is None or cand.sort_key < best.sort_key):
            best = cand
    return best
