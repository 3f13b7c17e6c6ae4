"""Checkpoint saves during training: how long a save holds the training loop, synchronous
(save_checkpoint) vs in the background (AsyncCheckpointer), and what the checksums cost.

    torchrun --standalone --nproc-per-node 4 bench/bench_checkpoint.py            # pp=2 x tp=2

A Llama (fp32, AdamW, zb-h1) trains; each round times, on every rank: a training step alone;
a synchronous save (the loop waits for all of it); an asynchronous save's stall (staging: the
gathers of tensors saved whole and the copies) and the training step that runs while the
background thread writes (against the step alone: what the writer takes from training on
shared cores); and, in a committed checkpoint, recording the files' CRC32C (what a save adds
for its checksums) and verifying them (what a load adds). Reported as median and spread
(max - min) / median over the rounds, the slowest rank's time per round.
"""
import argparse
import os
import shutil
import tempfile
import time

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

import torchpp
from timing import median_spread  # bench/timing.py, next to this script
from torchpp.checkpoint import AsyncCheckpointer, save_checkpoint, verify_checksums
from torchpp.checkpoint.checksums import record_checksums
from torchpp.models import parallelize
from torchpp.parallel import DistributedOptimizer


def slowest(seconds):
    t = torch.tensor(seconds, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    args = parser.parse_args()
    state = torchpp.init_parallel(tp=2, pp=2)
    torch.set_num_threads(1)
    config = LlamaConfig(vocab_size=4096, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3,
                         num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    model = parallelize(LlamaForCausalLM(config), schedule="zb-h1", n_microbatches=4, state=state)
    optimizer = DistributedOptimizer(model, torch.optim.AdamW, state, accumulations_per_step=4, lr=1e-4)
    ids = torch.randint(0, 4096, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))

    def train_step():
        start = time.perf_counter()
        optimizer.zero_grad()
        model.step(ids if model.has_first_stage else None, labels=ids if model.has_last_stage else None)
        optimizer.step()
        return time.perf_counter() - start

    root = args.dir or (tempfile.mkdtemp(prefix="torchpp_bench_ckpt_") if dist.get_rank() == 0 else None)
    box = [root]
    dist.broadcast_object_list(box)
    root = box[0]
    saver = AsyncCheckpointer(os.path.join(root, "async"))
    rows = {k: [] for k in ("step", "sync", "async stall", "step while writing", "async write (after the step)",
                            "record checksums", "verify checksums")}
    step = 0
    for round_ in range(args.repeats + 1):  # the first round warms up
        sample = {"step": slowest(train_step())}
        step += 1
        start = time.perf_counter()
        path = save_checkpoint(os.path.join(root, "sync"), step, model, optimizer)
        sample["sync"] = slowest(time.perf_counter() - start)
        start = time.perf_counter()
        sample["record checksums"] = slowest((record_checksums(path), time.perf_counter() - start)[1])
        start = time.perf_counter()
        verify_checksums(path)
        sample["verify checksums"] = slowest(time.perf_counter() - start)
        start = time.perf_counter()
        saver.save(step, model, optimizer)
        sample["async stall"] = slowest(time.perf_counter() - start)
        sample["step while writing"] = slowest(train_step())
        start = time.perf_counter()
        saver.wait()
        sample["async write (after the step)"] = slowest(time.perf_counter() - start)
        if round_:
            for key, value in sample.items():
                rows[key].append(value)
    saver.close()
    if dist.get_rank() == 0:
        files = os.path.join(root, "sync", f"step_{step}")
        size = sum(os.path.getsize(os.path.join(files, f)) for f in os.listdir(files))
        params = sum(p.numel() for p in LlamaForCausalLM(config).parameters())
        print(f"Llama h={args.hidden} L={args.layers} ({params / 1e6:.1f}M parameters), pp=2 x tp=2, AdamW fp32, "
              f"batch {args.batch} x {args.seq}; checkpoint {size / 2**20:.0f} MiB in {len(os.listdir(files))} files; "
              f"{args.repeats} rounds; the slowest rank's seconds")
        print("| what | median s | spread | vs a synchronous save |")
        print("|---|---|---|---|")
        sync = median_spread(rows["sync"])[0]
        for key, values in rows.items():
            median, spread = median_spread(values)
            print(f"| {key} | {median:.3f} | {spread:.0%} | {median / sync:.2f} |")
        if not args.dir:
            shutil.rmtree(root)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
