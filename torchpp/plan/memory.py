"""Memory model: Megatron-3 activation bytes per transformer layer, model state, per-rank totals.

Every formula is SPEC.md section 4 written for an element size E (E = 2 reproduces the
published 16-bit numbers): one layer keeps (16E + 2) sbh + (2E + 1) a s^2 b bytes without
parallelism (34 sbh + 5 as^2 b at E = 2; the 2 sbh and a s^2 b are 1-byte dropout masks).
"""
from __future__ import annotations

from typing import Optional

RECOMPUTE = ("none", "selective", "full")
ZERO_STAGES = (0, 1, 2, 3)


def layer_activation_bytes(
    seq_len: int,
    micro_batch: int,
    hidden: int,
    heads: int,
    tp: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
    element_bytes: int = 2,
    mask_bytes: int = 1,
    cp: int = 1,
) -> float:
    """Bytes one transformer layer keeps alive for backward, for one microbatch.

    Args:
        seq_len, micro_batch, hidden, heads: s, b, h, a.
        tp: tensor-parallel size t.
        sequence_parallel: LayerNorm/dropout regions split over t as well (Megatron-3 SP).
        recompute: "none", "selective" (attention core recomputed) or "full" (keep the input).
        element_bytes: E, bytes per activation element (2 for 16-bit, 4 for fp32).
        mask_bytes: bytes per dropout-mask element: 1 for a bool mask (fused GPU kernels),
            E where dropout keeps a scaled float mask (PyTorch's CPU path).
        cp: context-parallel size c: each rank holds s/c tokens (every term / c; the attention
            core is its s/c queries against all s keys, so it too falls by c).
    """
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")
    s, b, h, a, t, e, k = seq_len, micro_batch, hidden, heads, tp, element_bytes, mask_bytes
    if cp < 1 or s % cp:
        raise ValueError(f"cp={cp} must be at least 1 and divide the sequence length {s}")
    sbh = s // cp * b * h
    if recompute == "full":
        return e * sbh / (t if sequence_parallel else 1)
    # LayerNorm inputs, the QKV and first-MLP inputs and two dropout masks: replicated over TP
    # unless sequence parallel splits them.
    replicated = (4 * e + 2 * k) * sbh
    # Q, K, V, the projection input and both MLP hiddens (4h wide): split over TP.
    split = 12 * e * sbh
    attention_core = (2 * e + k) * a * (s // cp) * s * b  # softmax output, its dropout mask and output
    if recompute == "selective":
        attention_core = 0.0
    if sequence_parallel:
        return (replicated + split + attention_core) / t
    return replicated + split / t + attention_core / t


def model_state_bytes(
    num_parameters: float,
    dp: int = 1,
    zero1: bool = False,
    weight_bytes: float = 2,
    grad_bytes: float = 2,
    optimizer_bytes: float = 12,
    *,
    zero: Optional[int] = None,
    accumulating: bool = True,
    gathered_parameters: float = 0.0,
) -> float:
    """Weights + gradients + optimizer state per rank at the step's peak, by ZeRO stage.

    Defaults are Adam in mixed precision (SPEC section 4): 2 + 2 + 12 (fp32 master, m, v).
    Stage 1 (or ``zero1``) shards the optimizer state over dp. Stage 2 shards the gradients
    too, but a bucket's full gradient lives from its first accumulation of the step to its
    reduce-scatter after the last: with gradient accumulation over microbatches
    (``accumulating``, always under a pipeline) every bucket is full at the peak; without,
    only the shards and the buckets backward is filling (``gathered_parameters``' worth, about
    one layer). Stage 3 (torchpp's ZeRO-3 with reshard_after_forward) shards the weights too,
    holding in full only the module being run (``gathered_parameters``).

    Args:
        num_parameters: the rank's unsharded (TP-local) parameters.
        zero: the ZeRO stage 0..3 (default: 1 if zero1 else 0).
        accumulating: several microbatches accumulate into one step's gradients.
        gathered_parameters: parameters held in full at once besides the shards (one layer's).
    """
    stage = (1 if zero1 else 0) if zero is None else zero
    if stage not in ZERO_STAGES:
        raise ValueError(f"zero must be one of {ZERO_STAGES}, got {zero!r}")
    optimizer = optimizer_bytes / dp if stage >= 1 else optimizer_bytes
    grads = num_parameters * grad_bytes
    if stage >= 2 and not accumulating:
        grads = num_parameters * grad_bytes / dp + gathered_parameters * grad_bytes
    weights = num_parameters * weight_bytes
    if stage == 3:
        weights = num_parameters * weight_bytes / dp + gathered_parameters * weight_bytes
    return weights + grads + num_parameters * optimizer


def zero_traffic_bytes(stage: int, num_parameters: float, dp: int, num_microbatches: int, grad_bytes: float = 2,
                       weight_bytes: float = 2) -> float:
    """Bytes each rank sends over dp per step for the gradients and parameters (ring collectives).

    Stages 0-2 move one all-reduce's worth (stage 0 all-reduces the gradients; 1 and 2
    reduce-scatter them and all-gather the updated weights: the same volume). Stage 3 with
    reshard_after_forward reduce-scatters the gradients and all-gathers every weight twice per
    microbatch (its forward and its backward): the traffic that re-gathering multiplies.
    """
    if dp <= 1:
        return 0.0
    ring = (dp - 1) / dp
    if stage == 3:
        return ring * num_parameters * (grad_bytes + 2 * num_microbatches * weight_bytes)
    return 2 * ring * num_parameters * grad_bytes


def rank_activation_bytes(peak_inflight: float, layers_per_stage: float, per_layer_bytes: float) -> float:
    """Activations a pipeline rank holds at its peak: the schedule's in-flight stage-microbatches
    (``Simulation.peak_activations[rank]``) times the layers of one stage times bytes per layer."""
    return peak_inflight * layers_per_stage * per_layer_bytes
