"""Split B/W at Llama-7B sizes: one transformers LlamaDecoderLayer (hidden 4096, ffn 11008, 32
heads, SDPA), its input of one sequence of 4096 tokens, bf16. The backward three ways, the
same forward before each (not timed):

  fused   the standard backward (nn.Linear: weight gradients at once);
  I       the backward with the layer's linears on torch.ops.torchpp.split_bw_linear, weight
          gradients captured (torchpp.pipeline.split_linears);
  W       the captured weight gradients (weight_grad_store.run).

Goal: (I + W) / fused <= 1.05 (SPEC section 14).

    python bench/bench_split_bw.py            # CUDA, the sizes above
    python bench/bench_split_bw.py --small    # CPU-sized: hidden 256, ffn 688, 4 heads, seq 256, fp32
"""
from __future__ import annotations

import argparse
import time

import torch

from device_bench import add_arguments, device_of, fmt_ms, median_spread, synchronize, write_json


def build(args, device):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    if args.small:
        hidden, ffn, heads, seq, dtype = 256, 688, 4, 256, torch.float32
    else:
        hidden, ffn, heads, seq, dtype = 4096, 11008, 32, 4096, torch.bfloat16
    config = LlamaConfig(hidden_size=hidden, intermediate_size=ffn, num_attention_heads=heads,
                         num_key_value_heads=heads, max_position_embeddings=seq, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        layer = LlamaDecoderLayer(config, layer_idx=0).to(dtype)
    x = torch.randn(1, seq, hidden, device=device, dtype=dtype, requires_grad=True)
    positions = torch.arange(seq, device=device)[None]
    rotary = LlamaRotaryEmbedding(config).to(device)(x, positions)
    grad = torch.randn_like(x)
    return layer, x, rotary, grad, dict(hidden=hidden, ffn=ffn, heads=heads, seq=seq, dtype=str(dtype))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser, repeats=20)
    args = parser.parse_args()
    device = device_of(args)
    import torchpp  # noqa: F401
    from torchpp.pipeline import weight_grad_store
    from torchpp.pipeline.split_modules import split_linears, unsplit_linears

    layer, x, rotary, grad, shape = build(args, device)

    def forward():
        layer.zero_grad(set_to_none=True)
        x.grad = None
        return layer(x, position_embeddings=rotary)

    def timed(fn):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        return time.perf_counter() - start

    samples = {"fused": [], "I": [], "W": []}
    for k in range(args.repeats + 2):  # fused and split alternate; the first two rounds warm up
        unsplit_linears(layer)
        out = forward()
        fused = timed(lambda: out.backward(grad))
        split_linears(layer)
        out = forward()

        def input_pass():
            with weight_grad_store.capture(0, 0):
                out.backward(grad)
        i_time = timed(input_pass)
        w_time = timed(lambda: weight_grad_store.run(0, 0))
        if k >= 2:
            samples["fused"].append(fused)
            samples["I"].append(i_time)
            samples["W"].append(w_time)
    ratios = [(i + w) / f for i, w, f in zip(samples["I"], samples["W"], samples["fused"])]
    ratio, spread = median_spread(ratios)
    print(f"split B/W, one LlamaDecoderLayer on {device}: {shape}, {args.repeats} paired repeats")
    print("| pass | time |\n|---|---|")
    for name, times in samples.items():
        print(f"| {name} | {fmt_ms(times)} |")
    print(f"| (I + W) / fused, median of the per-repeat ratios | {ratio:.3f} (spread {spread:.0%}) |")
    write_json(args, {"bench": "split_bw", "shape": shape, "ratio": ratio, "ratio_spread": spread,
                      "median_s": {name: median_spread(t)[0] for name, t in samples.items()}})


if __name__ == "__main__":
    main()
