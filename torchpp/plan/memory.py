"""Memory model: Megatron-3 activation bytes per transformer layer, model state, per-rank totals.

Every formula is SPEC.md section 4 written for an element size E (E = 2 reproduces the
published 16-bit numbers): one layer keeps (16E + 2) sbh + (2E + 1) a s^2 b bytes without
parallelism (34 sbh + 5 as^2 b at E = 2; the 2 sbh and a s^2 b are 1-byte dropout masks).
"""
from __future__ import annotations

RECOMPUTE = ("none", "selective", "full")


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
) -> float:
    """Weights + gradients + optimizer state per rank; ZeRO-1 shards the optimizer over dp.

    Defaults are Adam in mixed precision (SPEC section 4): 2 + 2 + 12 (fp32 master, m, v).
    """
    optimizer = optimizer_bytes / dp if zero1 else optimizer_bytes
    return num_parameters * (weight_bytes + grad_bytes + optimizer)


def rank_activation_bytes(peak_inflight: float, layers_per_stage: float, per_layer_bytes: float) -> float:
    """Activations a pipeline rank holds at its peak: the schedule's in-flight stage-microbatches
    (``Simulation.peak_activations[rank]``) times the layers of one stage times bytes per layer."""
    return peak_inflight * layers_per_stage * per_layer_bytes
