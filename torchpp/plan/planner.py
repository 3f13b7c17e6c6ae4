"""Planner: enumerate (tp, pp, cp, dp, microbatch, v, schedule, recompute, ZeRO stage), drop
what does not fit in memory, rank the rest by simulated step time.

Compute costs come from FLOPs at a stated efficiency (SPEC section 3 per-layer F, I, W), TP and
DP from ring all-reduce volumes, PP sends from b*s*h/t per boundary (scatter/gather), all over
the link each group actually uses (intra-node when the group fits in a node). The pipeline part
of a step is the schedule simulator's makespan; DP gradient reduction (and ZeRO-3's parameter
gathers) is added, not overlapped.
Context parallelism (cp) gives each rank s/c tokens of every sequence: activations, compute and
stage-boundary sends fall by c; each layer passes key/value shards around the cp ring (forward
once, backward with their gradients twice), hidden behind the attention blocks' compute where
that is longer; gradients reduce over dp x cp (Megatron's dp-cp group).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from torchpp.plan.memory import RECOMPUTE, ZERO_STAGES, layer_activation_bytes, model_state_bytes, zero_traffic_bytes
from torchpp.plan.model_config import ModelConfig
from torchpp.plan.schedule_sim import simulate_schedule


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
        ("interleaved-zb", 2), ("interleaved-zb", 4))
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


def plan(model: ModelConfig, cluster: Cluster, training: Training) -> Plan:
    """Ranks every layout that fits; raises ``PlanError`` when none does.

    Args:
        model: the transformer's shape.
        cluster: GPUs, memory and links.
        training: global batch, sequence length, and the microbatch sizes and schedules to try.
    """
    _check_possible(model, cluster, training)
    ranked, rejected, smallest = [], {}, None
    for layout in _layouts(model, cluster, training):
        try:
            candidate = evaluate(model, cluster, training, layout)
        except ValueError:  # the schedule cannot serve (p, m, v)
            rejected["schedule constraint"] = rejected.get("schedule constraint", 0) + 1
            continue
        if candidate.memory_per_gpu > cluster.gpu_memory:
            rejected["out of memory"] = rejected.get("out of memory", 0) + 1
            if smallest is None or candidate.memory_per_gpu < smallest.memory_per_gpu:
                smallest = candidate
            continue
        ranked.append(candidate)
    if not ranked:
        detail = ""
        if smallest is not None:
            detail = (f"; the least memory any layout needs is {smallest.memory_per_gpu / 1e9:.1f} GB per GPU "
                      f"({_describe(smallest.layout)}) > {cluster.gpu_memory / 1e9:.1f} GB")
        raise PlanError(f"no layout of {model.name} fits on {cluster.num_gpus} GPUs{detail}")
    ranked.sort(key=lambda c: c.sort_key)
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
                    yield Layout(tp, pp, dp, b, m, v, schedule, recompute, zero, cp)


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


def evaluate(model: ModelConfig, cluster: Cluster, training: Training, layout: Layout) -> Candidate:
    """Step time, bubble and per-GPU memory of one layout (rank order: TP fastest, then CP, DP, PP)."""
    t, p, d, b, v, c = layout.tp, layout.pp, layout.dp, layout.micro_batch, layout.chunks, layout.cp
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
    if layout.recompute == "full":
        i_layer += f_layer
    elif layout.recompute == "selective":
        i_layer += 4 * b * local * s * h  # attention scores and attention over values, recomputed
    tp_allreduce = _allreduce_seconds(b * local * h * e, t, _link(cluster, t))
    cp_forward, cp_backward = _cp_ring_seconds(model, cluster, b, local, e, t, c, flops_rate)
    recompute_allreduces = 2 if layout.recompute == "full" else 0
    recompute_rings = cp_forward if layout.recompute in ("full", "selective") else 0.0
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
    f = tuple(f_stage + exposed + (head if k == stages - 1 else 0.0) for k in range(stages))
    i = tuple(i_stage + exposed + (head if k == stages - 1 else 0.0) for k in range(stages))
    w = tuple(w_stage + (head if k == stages - 1 else 0.0) for k in range(stages))

    if p == 1:
        makespan = layout.num_microbatches * (f[0] + i[0] + w[0])
        bubble, peaks = 0.0, (1.0,)
    else:
        run = simulate_schedule(layout.schedule, p, layout.num_microbatches, v, f, i, w, p2p)
        makespan, bubble, peaks = run.makespan, run.bubble_ratio, run.peak_activations

    params_per_rank = _parameters_per_rank(model, p, v, layout.schedule)
    # ZeRO-1/2 move one all-reduce's worth (reduce-scatter + all-gather); ZeRO-3 re-gathers weights.
    zero_bytes = zero_traffic_bytes(layout.zero, max(params_per_rank) / t, d * c, layout.num_microbatches,
                                    training.grad_bytes, training.weight_bytes)
    dp_sync = zero_bytes / _link(cluster, t * c * d) if d * c > 1 else 0.0

    sp = training.sequence_parallel and t > 1
    act_layer = layer_activation_bytes(s, b, h, model.heads, t, sequence_parallel=sp, recompute=layout.recompute,
                                       element_bytes=e, cp=c)
    logits = 4.0 * b * local * model.vocab / t  # fp32 logits of the microbatch in its loss
    # Recompute rebuilds one layer's activations in its backward: they are live on top of the kept ones.
    working = 0.0 if layout.recompute == "none" else layer_activation_bytes(
        s, b, h, model.heads, t, sequence_parallel=sp, element_bytes=e, cp=c)
    last_rank = 0 if layout.schedule in ("zb-v", "dualpipe-v") else p - 1
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

    work_per_rank = layout.num_microbatches * (sum(f) + sum(i) + sum(w)) / p
    tp_comm = layout.num_microbatches * v * layers_per_stage * (4 + recompute_allreduces) * tp_allreduce
    cp_comm = layout.num_microbatches * v * layers_per_stage * (cp_forward + cp_backward + recompute_rings)
    pp_comm = layout.num_microbatches * v * 2 * exposed
    breakdown = {
        "compute": work_per_rank - tp_comm - cp_comm - pp_comm,
        "tp_comm": tp_comm,
        "cp_comm": cp_comm,
        "pp_comm": pp_comm,
        "pipeline_idle": makespan - work_per_rank,  # bubble, exposed sends, the head's extra stage load
        "dp_sync": dp_sync,
    }
    return Candidate(layout, makespan + dp_sync, bubble, max(memory), breakdown)


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
    link = _link(cluster, t * c)
    block = 4 * b * local * local * model.hidden / flops_rate  # over the t GPUs of the TP group
    forward = (c - 1) * max(0.0, shard / link - block)
    backward = (c - 1) * max(0.0, 2 * shard / link - 2 * block)
    return forward, backward


def _parameters_per_rank(model: ModelConfig, p: int, v: int, schedule: str) -> list[float]:
    """Unsharded parameters on each pipeline rank: its layers, the embedding on the first stage's
    rank, the output layer (a second copy when tied) on the last stage's rank."""
    per_rank = [model.num_layers // p * model.layer_parameters for _ in range(p)]
    first, last = 0, (0 if schedule in ("zb-v", "dualpipe-v") else p - 1)
    per_rank[first] += model.embedding_parameters
    if first != last or not model.tied_embeddings:
        per_rank[last] += model.embedding_parameters
    return per_rank


def _describe(layout: Layout) -> str:
    return (f"tp={layout.tp} pp={layout.pp}{f' cp={layout.cp}' if layout.cp > 1 else ''} dp={layout.dp} "
            f"b={layout.micro_batch} {layout.schedule}"
            f"{f' v={layout.chunks}' if layout.chunks > 1 else ''} recompute={layout.recompute}"
            f"{f' zero{layout.zero}' if layout.zero else ''}")
