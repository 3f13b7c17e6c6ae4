"""Model FLOPs per token (the MFU numerator) and a measured matmul peak (its denominator).

Model FLOPs count the matmuls of one training step, forward and backward (2 + 4 FLOPs per
weight per token), plus attention's scores and weighted sum, 12 * layers * heads * head_dim *
seq per token (PaLM's convention, the whole s x s matrix, as torchtitan and Megatron count):
recomputation is not counted, so MFU is the same with or without it.
"""
from __future__ import annotations

import time

import torch
from torch import nn


def training_flops_per_token(model: nn.Module, seq_len: int) -> float:
    """FLOPs of one training step per token, from the unsharded model's Linear layers and its
    config (num_hidden_layers, num_attention_heads, head_dim or hidden_size / heads).

    Args:
        model: the whole model (before parallelize; the meta device will do).
        seq_len: tokens per sequence.
    """
    matmul_weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    config = model.config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    attention = 12 * config.num_hidden_layers * heads * head_dim * seq_len
    return 6.0 * matmul_weights + attention


def measure_matmul_tflops(device: torch.device, dtype: torch.dtype = torch.float32, size: int = 512,
                          seconds: float = 0.3) -> float:
    """TFLOP/s of square matmuls on `device` as this process runs them now (its threads, and on
    a shared CPU, its share of the cores): the peak MFU is measured against without --peak-tflops."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    torch.matmul(a, b)  # warm-up
    sync = torch.accelerator.synchronize if device.type != "cpu" else (lambda: None)
    sync()
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        torch.matmul(a, b)
        count += 1
    sync()
    return 2 * size ** 3 * count / (time.perf_counter() - start) / 1e12
