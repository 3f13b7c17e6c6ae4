"""What one layout costs: per-stage pass times, step time, bubble and per-GPU memory.

Compute costs come from FLOPs at a stated efficiency (SPEC section 3 per-layer F, I, W), TP and
DP from ring all-reduce volumes, PP sends from b*s*h/t per boundary (scatter/gather), all over
the link each group actually uses (intra-node when the group fits in a node). The pipeline part
of a step is the schedule simulator's makespan; DP gradient reduction (and ZeRO-3's parameter
gathers) is added, not overlapped.
Context parallelism (cp) gives each rank s/c tokens of every sequence: activations, compute and
stage-boundary sends fall by c; each layer passes key/value shards around the cp ring (forward
once, backward with their gradients twice), hidden behind the attention blocks' compute where
that is longer, or (all-to-all) trades its q, k, v and output shards for its heads' whole
sequence, exposed; gradients reduce over dp x cp (Megatron's dp-cp group).

The pieces that need no simulation (``pass_costs``, ``dp_sync_seconds``, ``rank_memory``) are
shared with the planner's bounds (torchpp.plan.search), so a bound and the evaluation it bounds
can never disagree on a cost.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from torchpp.plan.layout import Candidate, Cluster, Layout, Training
from torchpp.plan.memory import layer_activation_bytes, model_state_bytes, zero_traffic_bytes
from torchpp.plan.model_config import ModelConfig
from torchpp.plan.schedule_sim import ScheduleRun, simulate_schedule

# Schedules whose last stage sits on rank 0 (the V placement: rank r holds stages r and 2p-1-r).
V_SHAPED = ("zb-v", "v-half", "v-min", "dualpipe-v")


@dataclass(frozen=True)
class PassCosts:
    """Seconds per microbatch of each pipeline stage's passes, and the per-layer comm terms."""

    f: tuple[float, ...]
    i: tuple[float, ...]
    w: tuple[float, ...]
    p2p: float  # one stage-boundary transfer (the simulator's comm latency)
    exposed: float  # of it, what a blocking exchange adds to each F and I
    tp_allreduce: float
    cp_forward: float
    cp_backward: float
    recompute_allreduces: int
    recompute_rings: float
    layers_per_stage: int


def _allreduce_seconds(nbytes: float, group: int, bandwidth: float) -> float:
    return 2.0 * (group - 1) / group * nbytes / bandwidth if group > 1 else 0.0


def _link(cluster: Cluster, span: int) -> float:
    """Bandwidth of a group spread over `span` consecutive ranks: intra-node only when every such
    group lies inside one node (span divides the node), else its slowest hop crosses nodes."""
    inside = span <= cluster.gpus_per_node and cluster.gpus_per_node % span == 0
    return cluster.intra_node_bandwidth if inside else cluster.inter_node_bandwidth


def _p2p_seconds(cluster: Cluster, nbytes: float, t: int, d: int, p: int) -> float:
    """One stage-boundary transfer of ``nbytes`` (b*s*h elements) with Megatron-2's scatter/gather
    (SPEC section 5): each TP rank sends nbytes/t, the receivers all-gather it inside the node.
    A stage's ranks are t*d consecutive GPUs, so the pipeline crosses nodes as soon as its p*t*d
    ranks span more than one; every boundary then waits on its slowest (inter-node) hop."""
    crosses = t * d * p > cluster.gpus_per_node
    send = nbytes / t / (cluster.inter_node_bandwidth if crosses else cluster.intra_node_bandwidth)
    gather = (t - 1) / t * nbytes / cluster.intra_node_bandwidth if t > 1 else 0.0
    return send + gather


def _cp_ring_seconds(model: ModelConfig, cluster: Cluster, b: int, local: int, e: int, t: int, c: int,
                     flops_rate: float) -> tuple[float, float]:
    """Exposed seconds per layer of the cp ring (forward, backward): c-1 steps, each passing one
    rank's key/value shard (b * s/c * 2 kv-width / t elements; backward also their gradients)
    while the attention block of the shard in hand computes (4 b (s/c)^2 h / t FLOPs forward,
    twice that backward); a step costs the longer of the two, minus its compute."""
    if c == 1:
        return 0.0, 0.0
    kv_width = model.hidden * (model.kv_heads or model.heads) / model.heads
    shard = 2 * b * local * kv_width / t * e
    block = 4 * b * local * local * model.hidden / flops_rate  # over the t GPUs of the TP group
    return _ring_exposed(c - 1, shard, _link(cluster, t * c), block)


def _ring_exposed(steps: int, shard_bytes: float, link: float, block_seconds: float) -> tuple[float, float]:
    """A ring's exposed (forward, backward) seconds: each step's transfer (backward: the shard and
    its gradient) less the block computed beside it (backward: twice the FLOPs)."""
    forward = steps * max(0.0, shard_bytes / link - block_seconds)
    backward = steps * max(0.0, 2 * shard_bytes / link - 2 * block_seconds)
    return forward, backward


def _cp_hierarchical_seconds(model: ModelConfig, cluster: Cluster, b: int, local: int, e: int, t: int, c: int,
                             a: int, flops_rate: float) -> tuple[float, float]:
    """All-to-all inside groups of a cp ranks (counted whole, over their span's link), then the ring
    across the c / a groups: each step passes a times the tokens with 1/a of the (repeated)
    key/value heads, beside a block of a times the queries against a times the keys with 1/a of
    the heads (a times the ring's block)."""
    inner_forward, inner_backward = _cp_all_to_all_seconds(model, cluster, b, local, e, t, a)
    steps = c // a - 1
    if steps == 0:
        return inner_forward, inner_backward
    local_kv_heads = max((model.kv_heads or model.heads) // t, 1)
    repeats = a // math.gcd(local_kv_heads, a)
    shard = 2 * b * local * local_kv_heads * repeats * (model.hidden / model.heads) * e
    block = a * 4 * b * local * local * model.hidden / flops_rate
    ring_forward, ring_backward = _ring_exposed(steps, shard, _link(cluster, t * c), block)
    return inner_forward + ring_forward, inner_backward + ring_backward


def _cp_all_to_all_seconds(model: ModelConfig, cluster: Cluster, b: int, local: int, e: int, t: int,
                           c: int) -> tuple[float, float]:
    """Seconds per layer of all-to-all cp attention (forward, backward), none hidden: forward trades
    q, k and v in and the output out, backward the output's gradient in and q's, k's and v's out;
    each rank keeps 1/c of every tensor it sends (b * s/c * width / t elements); key/value heads c
    does not divide travel repeated."""
    if c == 1:
        return 0.0, 0.0
    local_kv_heads = max((model.kv_heads or model.heads) // t, 1)
    repeats = c // math.gcd(local_kv_heads, c)
    head_dim = model.hidden / model.heads
    widths = 2 * model.hidden / t + 2 * local_kv_heads * repeats * head_dim  # q and out, k and v
    seconds = (c - 1) / c * b * local * widths * e / _link(cluster, t * c)
    return seconds, seconds


@functools.lru_cache(maxsize=65536)
def pass_costs(model: ModelConfig, cluster: Cluster, training: Training, t: int, p: int, d: int, b: int, v: int,
               c: int, recompute: str, cp_mode: str = "ring", cp_all_to_all_size: int = 0) -> PassCosts:
    """Per-stage F, I, W seconds of one microbatch (the last stage also runs the output layer)."""
    s, h, e = training.seq_len, model.hidden, training.element_bytes
    local = s // c  # tokens of each sequence on this rank
    stages, layers_per_stage = p * v, model.num_layers // (p * v)
    flops_rate = t * cluster.peak_flops * cluster.efficiency

    # Per layer, per microbatch (SPEC section 3): F = bs(2P + 4sh), I = bs(2P + 8sh), W = 2bsP;
    # under cp a rank's s/c queries still attend to all s keys.
    weights = model.layer_parameters
    f_layer = b * local * (2 * weights + 4 * s * h)
    i_layer = b * local * (2 * weights + 8 * s * h)
    w_layer = 2 * b * local * weights
    if recompute == "full":
        i_layer += f_layer
    elif recompute == "selective":
        i_layer += 4 * b * local * s * h  # attention scores and attention over values, recomputed
    tp_allreduce = _allreduce_seconds(b * local * h * e, t, _link(cluster, t))
    if cp_mode == "all-to-all":
        cp_forward, cp_backward = _cp_all_to_all_seconds(model, cluster, b, local, e, t, c)
    elif cp_mode == "all-to-all+ring":
        cp_forward, cp_backward = _cp_hierarchical_seconds(model, cluster, b, local, e, t, c, cp_all_to_all_size,
                                                           flops_rate)
    else:
        cp_forward, cp_backward = _cp_ring_seconds(model, cluster, b, local, e, t, c, flops_rate)
    recompute_allreduces = 2 if recompute == "full" else 0
    recompute_rings = cp_forward if recompute in ("full", "selective") else 0.0
    f_stage = layers_per_stage * (f_layer / flops_rate + 2 * tp_allreduce + cp_forward)
    i_stage = layers_per_stage * (i_layer / flops_rate + (2 + recompute_allreduces) * tp_allreduce + cp_backward
                                  + recompute_rings)
    w_stage = layers_per_stage * w_layer / flops_rate
    # The output layer (logits, loss) sits on the last stage.
    head = 2 * b * local * h * model.vocab / flops_rate
    p2p = _p2p_seconds(cluster, b * local * h * e, t, d * c, p) if p > 1 else 0.0
    # Blocking exchanges: one after each stage's forward (send output, receive a gradient) and one
    # after its backward (send the gradient, receive the next input).
    exposed = p2p if training.blocking_p2p else 0.0
    last = stages - 1
    f = tuple(f_stage + exposed + (head if k == last else 0.0) for k in range(stages))
    i = tuple(i_stage + exposed + (head if k == last else 0.0) for k in range(stages))
    w = tuple(w_stage + (head if k == last else 0.0) for k in range(stages))
    return PassCosts(f, i, w, p2p, exposed, tp_allreduce, cp_forward, cp_backward, recompute_allreduces,
                     recompute_rings, layers_per_stage)


def parameters_per_rank(model: ModelConfig, p: int, schedule: str) -> list[float]:
    """Unsharded parameters on each pipeline rank: its layers, the embedding on the first stage's
    rank, the output layer (a second copy when tied) on the last stage's rank."""
    per_rank = [model.num_layers // p * model.layer_parameters for _ in range(p)]
    first, last = 0, (0 if schedule in V_SHAPED else p - 1)
    per_rank[first] += model.embedding_parameters
    if first != last or not model.tied_embeddings:
        per_rank[last] += model.embedding_parameters
    return per_rank


def dp_sync_seconds(model: ModelConfig, cluster: Cluster, training: Training, layout: Layout) -> float:
    """Gradient reduction (ZeRO-1/2: reduce-scatter + all-gather; ZeRO-3 re-gathers weights) over dp x cp."""
    t, p, d, c = layout.tp, layout.pp, layout.dp, layout.cp
    if d * c == 1:
        return 0.0
    params = max(parameters_per_rank(model, p, layout.schedule)) / t
    zero_bytes = zero_traffic_bytes(layout.zero, params, d * c, layout.num_microbatches, training.grad_bytes,
                                    training.weight_bytes)
    return zero_bytes / _link(cluster, t * c * d)


def rank_memory(model: ModelConfig, training: Training, layout: Layout, peaks) -> list[float]:
    """Bytes on each pipeline rank's GPUs at the step's peak: model state plus ``peaks[rank]``
    in-flight stage-microbatches of activations (and the loss's logits on the last stage's rank)."""
    t, p, d, b, v, c = layout.tp, layout.pp, layout.dp, layout.micro_batch, layout.chunks, layout.cp
    s, h, e = training.seq_len, model.hidden, training.element_bytes
    local, layers_per_stage = s // c, model.num_layers // (p * v)
    params_per_rank = parameters_per_rank(model, p, layout.schedule)
    sp = training.sequence_parallel and t > 1
    act_layer = layer_activation_bytes(s, b, h, model.heads, t, sequence_parallel=sp, recompute=layout.recompute,
                                       element_bytes=e, cp=c)
    logits = 4.0 * b * local * model.vocab / t  # fp32 logits of the microbatch in its loss
    # Recompute rebuilds one layer's activations in its backward: they are live on top of the kept ones.
    working = 0.0 if layout.recompute == "none" else layer_activation_bytes(
        s, b, h, model.heads, t, sequence_parallel=sp, element_bytes=e, cp=c)
    last_rank = 0 if layout.schedule in V_SHAPED else p - 1
    memory = []
    for rank in range(p):
        state = model_state_bytes(params_per_rank[rank] / t, dp=d * c, zero=layout.zero,
                                  weight_bytes=training.weight_bytes,
                                  grad_bytes=training.grad_bytes, optimizer_bytes=training.optimizer_bytes,
                                  accumulating=layout.num_microbatches > 1,
                                  gathered_parameters=model.layer_parameters / t)
        activations = (peaks[rank] * layers_per_stage * act_layer + working
                       + (logits if rank == last_rank else 0.0))
        memory.append(state + activations)
    return memory


def costs_of(model: ModelConfig, cluster: Cluster, training: Training, layout: Layout) -> PassCosts:
    return pass_costs(model, cluster, training, layout.tp, layout.pp, layout.dp, layout.micro_batch,
                      layout.chunks, layout.cp, layout.recompute, layout.cp_mode, layout.cp_all_to_all_size or 0)


def run_schedule(costs: PassCosts, layout: Layout, exact: bool = True) -> ScheduleRun:
    """The pipeline's makespan, bubble and peak in-flight activations (one rank: no pipeline)."""
    if layout.pp == 1:
        makespan = layout.num_microbatches * (costs.f[0] + costs.i[0] + costs.w[0])
        return ScheduleRun(makespan, 0.0, (1.0,))
    return simulate_schedule(layout.schedule, layout.pp, layout.num_microbatches, layout.chunks, costs.f, costs.i,
                             costs.w, costs.p2p, exact=exact)


def candidate(model: ModelConfig, cluster: Cluster, training: Training, layout: Layout, run: ScheduleRun,
              costs: PassCosts | None = None) -> Candidate:
    """The ranked entry of ``layout`` given its schedule's simulated ``run``."""
    costs = costs or costs_of(model, cluster, training, layout)
    m, v = layout.num_microbatches, layout.chunks
    dp_sync = dp_sync_seconds(model, cluster, training, layout)
    memory = rank_memory(model, training, layout, run.peak_activations)
    work_per_rank = m * (sum(costs.f) + sum(costs.i) + sum(costs.w)) / layout.pp
    layers = v * costs.layers_per_stage
    tp_comm = m * layers * (4 + costs.recompute_allreduces) * costs.tp_allreduce
    cp_comm = m * layers * (costs.cp_forward + costs.cp_backward + costs.recompute_rings)
    pp_comm = m * v * 2 * costs.exposed
    breakdown = {
        "compute": work_per_rank - tp_comm - cp_comm - pp_comm,
        "tp_comm": tp_comm,
        "cp_comm": cp_comm,
        "pp_comm": pp_comm,
        "pipeline_idle": run.makespan - work_per_rank,  # bubble, exposed sends, the head's extra stage load
        "dp_sync": dp_sync,
    }
    return Candidate(layout, run.makespan + dp_sync, run.bubble_ratio, max(memory), breakdown)


def evaluate(model: ModelConfig, cluster: Cluster, training: Training, layout: Layout) -> Candidate:
    """Step time, bubble and per-GPU memory of one layout (rank order: TP fastest, then CP, DP, PP)."""
    costs = costs_of(model, cluster, training, layout)
    return candidate(model, cluster, training, layout, run_schedule(costs, layout), costs)
