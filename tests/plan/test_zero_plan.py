"""ZeRO stages 2 and 3 in the memory model and the planner: per-rank weight, gradient and
optimizer bytes and the extra traffic, and a budget that only the sharded stages meet."""
import dataclasses

import pytest

from torchpp.plan import PRESETS, Cluster, Training, evaluate, model_state_bytes, plan, zero_traffic_bytes
from torchpp.plan.planner import Layout


def test_state_bytes_by_stage():
    n, d, layer = 1e9, 8, 1e7  # parameters, dp, one layer's parameters
    w, g, o = 2, 2, 12
    assert model_state_bytes(n, dp=d, zero=0) == n * (w + g + o)
    assert model_state_bytes(n, dp=d, zero=1) == model_state_bytes(n, dp=d, zero1=True) == n * (w + g + o / d)
    # Gradient accumulation keeps every bucket's full gradient until its last microbatch.
    assert model_state_bytes(n, dp=d, zero=2, gathered_parameters=layer) == n * (w + g + o / d)
    assert model_state_bytes(n, dp=d, zero=2, accumulating=False, gathered_parameters=layer) == pytest.approx(
        n * (w + g / d + o / d) + layer * g)
    assert model_state_bytes(n, dp=d, zero=3, accumulating=False, gathered_parameters=layer) == pytest.approx(
        n * (w + g + o) / d + layer * (w + g))
    with pytest.raises(ValueError, match="zero must be one of"):
        model_state_bytes(n, zero=4)


def test_traffic_by_stage():
    n, d, m = 1e9, 4, 8
    all_reduce = 2 * 3 / 4 * n * 2
    assert zero_traffic_bytes(0, n, d, m) == zero_traffic_bytes(1, n, d, m) == zero_traffic_bytes(2, n, d, m) == all_reduce
    assert zero_traffic_bytes(3, n, d, m) == pytest.approx(3 / 4 * n * (2 + 2 * m * 2))  # weights gathered twice per microbatch
    assert zero_traffic_bytes(3, n, 1, m) == 0.0


def test_planner_proposes_zero3_when_only_sharded_weights_fit():
    model, cluster_gpus = PRESETS["gpt-1.3b"], 8
    training = Training(8, 1024, micro_batches=(1,), recompute=("full",))  # dp=8: one microbatch each
    layouts = {zero: Layout(1, 1, 8, 1, 1, 1, "none", "full", zero) for zero in range(4)}
    memory = {zero: evaluate(model, Cluster(cluster_gpus, 1e12), training, lay).memory_per_gpu
              for zero, lay in layouts.items()}
    assert memory[0] > memory[1] > memory[2] > memory[3]
    # A budget between ZeRO-3's need and ZeRO-2's, with no room for tp or pp to help enough:
    budget = (memory[2] + memory[3]) / 2
    only_dp = dataclasses.replace(training, schedules=())
    result = plan(model, Cluster(cluster_gpus, budget), only_dp)
    assert {c.layout.zero for c in result.ranked if (c.layout.tp, c.layout.pp) == (1, 1)} == {3}
    zero3 = next(c for c in result.ranked if c.layout == layouts[3])
    # Its extra traffic is the price: two weight gathers per microbatch on top of the reduce-scatter.
    zero2_time = evaluate(model, Cluster(cluster_gpus, 1e12), training, layouts[2]).breakdown["dp_sync"]
    assert zero3.breakdown["dp_sync"] > zero2_time
