"""MFU of one pipeline stage: forward + backward of 4 Llama-7B-shaped transformers layers
(hidden 4096, ffn 11008, 32 heads, SDPA, one sequence of 4096 tokens, bf16) wrapped by
torchpp's parallelize at tp=1, as a fraction of the peak measured on the same device by an
8192^3 bf16 matmul in the same run. Goal: >= 0.6 (SPEC section 14).

FLOPs per layer and token-sequence (s tokens, hidden h, ffn f): forward 8sh^2 (q, k, v, o)
+ 6shf (gate, up, down) + 4s^2h (scores and weighted sum, counted whole as Megatron does),
backward twice the forward; the vocabulary is 256, its embedding and head left out.

    python bench/bench_stage_mfu.py           # CUDA, the sizes above
    python bench/bench_stage_mfu.py --small   # CPU-sized: hidden 256, ffn 688, 4 heads, seq 256, fp32
"""
from __future__ import annotations

import argparse

import torch

from device_bench import (add_arguments, device_of, fmt_ms, median_spread, single_rank_group, time_variants,
                          write_json)


def matmul_peak(device, small, repeats):
    n, dtype = (1024, torch.float32) if small else (8192, torch.bfloat16)
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    times = time_variants({"matmul": lambda: torch.mm(a, b)}, device, repeats, warmup=3)["matmul"]
    return 2 * n ** 3 / median_spread(times)[0], n, dtype


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser, repeats=10)
    args = parser.parse_args()
    device = device_of(args)
    single_rank_group(device)
    import torchpp
    from transformers import LlamaConfig, LlamaForCausalLM

    from torchpp.models import parallelize

    peak, n, peak_dtype = matmul_peak(device, args.small, args.repeats)
    print(f"| measured peak, {n}^3 {peak_dtype} matmul | {peak / 1e12:.3g} TFLOP/s |", flush=True)
    if args.small:
        h, f, heads, s, layers, dtype = 256, 688, 4, 256, 4, torch.float32
    else:
        h, f, heads, s, layers, dtype = 4096, 11008, 32, 4096, 4, torch.bfloat16
    config = LlamaConfig(vocab_size=256, hidden_size=h, intermediate_size=f, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=s,
                         attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it runs: 800M parameters take seconds on a CPU
        model = LlamaForCausalLM._from_config(config, dtype=dtype)
    state = torchpp.init_parallel(tp=1)
    model = parallelize(model, state=state)
    ids = torch.randint(0, 256, (1, s), device=state.device)

    def step():
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()

    times = time_variants({"step": step}, device, args.repeats)["step"]
    flops = 3 * layers * (8 * s * h * h + 6 * s * h * f + 4 * s * s * h)
    achieved = flops / median_spread(times)[0]
    print(f"stage MFU on {device}: {layers} layers, hidden {h}, ffn {f}, {heads} heads, seq {s}, {dtype}")
    print(f"| forward + backward of the stage | {fmt_ms(times)}, {flops / 1e12:.3g} TFLOP |")
    print(f"| achieved | {achieved / 1e12:.3g} TFLOP/s |")
    print(f"| MFU, fraction of the measured peak | {achieved / peak:.3f} |")
    write_json(args, {"bench": "stage_mfu", "peak_flops": peak, "achieved_flops": achieved, "mfu": achieved / peak,
                      "step_s": median_spread(times)[0], "step_spread": median_spread(times)[1]})


if __name__ == "__main__":
    main()
