"""torchpp main demo: a tiny Llama from transformers trained with PTD-P on CPU ranks.

    torchrun --nproc-per-node 4 examples/train_llama.py            # pp=2 x tp=2, zb-h1
    torchrun --nproc-per-node 8 examples/train_llama.py            # pp=2 x tp=2 x dp=2
    torchrun --nproc-per-node 4 examples/train_llama.py --zero --schedule interleaved-1f1b  # --zero 2 / --zero 3: ZeRO-2/3
    torchrun --nproc-per-node 4 examples/train_llama.py --schedule dualpipe --microbatches 4
    torchrun --nproc-per-node 4 examples/train_llama.py --fp16     # fp16 autocast, dynamic loss scaling
    torchrun --nproc-per-node 4 examples/train_llama.py --fp16 --post-validate   # no wait for norm/inf checks
    torchrun --nproc-per-node 4 examples/train_llama.py --save-hf runs/hf          # then from_pretrained reads it
    torchrun --nproc-per-node 4 examples/train_llama.py --init-from runs/hf        # fine-tune a checkpoint

The model is a random tiny LlamaForCausalLM (no download), or, with --init-from, any causal LM
folder parallelize takes (built on the meta device, each rank loading only its shards).
torchpp.models.parallelize shards
it over tp (Column/RowParallelLinear, vocab-parallel embedding and loss) and cuts its decoder
layers into pp pipeline stages run by the given schedule; the DistributedOptimizer reduces
gradients over dp (or shards Adam's state, --zero) and clips by the global norm. The task is
synthetic and learnable (arithmetic progressions modulo the vocabulary), so the loss falls.
The last step's real-run Chrome trace (all ranks in one file: chrome://tracing or Perfetto)
and its timeline picture go to --out. The same script runs on GPUs (NCCL) unchanged.
"""
import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from tqdm import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import torchpp
from torchpp.models import load_hf_weights, parallelize, save_hf_checkpoint
from torchpp.parallel import DistributedOptimizer, GradScaler
from torchpp.pipeline import export_chrome_trace, plot_timeline
from torchpp.pipeline.trace import gather_runs, measured_costs, measured_simulation, predicted_simulation
from torchpp.tensor_parallel import model_parallel_manual_seed


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size")
    parser.add_argument("--pp", type=int, default=2, help="pipeline-parallel size (dp = world / (tp*pp*cp))")
    parser.add_argument("--cp", type=int, default=1, help="context-parallel size: each sequence split over cp ranks")
    parser.add_argument("--schedule", default="zb-h1", help="any torchpp.schedule name")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--zero", type=int, nargs="?", const=1, default=0, choices=(0, 1, 2, 3),
                        help="ZeRO stage over dp: 1 (the flag alone) shards Adam's state, 2 the gradients too, "
                             "3 the weights too")
    parser.add_argument("--recompute", choices=["full", "selective"], default=None)
    precision = parser.add_mutually_exclusive_group()
    precision.add_argument("--bf16", action="store_true", help="mixed precision: the step under torch.autocast(bf16)")
    precision.add_argument("--fp16", action="store_true",
                           help="mixed precision: torch.autocast(fp16) with dynamic loss scaling (GradScaler)")
    parser.add_argument("--post-validate", action="store_true",
                        help="optimizer post-validation: update without waiting for the global norm (and the fp16 "
                             "inf check); an update that should have been clipped or skipped is redone and the "
                             "batch after it runs again")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--out", default="runs/llama", help="directory for trace.json and timeline.png")
    parser.add_argument("--init-from", default=None,
                        help="a transformers checkpoint folder (save_pretrained's) to start from instead of a random "
                             "tiny Llama")
    parser.add_argument("--save-hf", default=None, help="write the trained model here as a transformers checkpoint")
    return parser.parse_args()


def progression_batch(generator, batch, seq, vocab):
    """Token ids counting up from random starts by random strides 1..3 (mod vocab)."""
    start = torch.randint(0, vocab, (batch, 1), generator=generator)
    stride = torch.randint(1, 4, (batch, 1), generator=generator)
    return (start + stride * torch.arange(seq)) % vocab


def step_loss(model, loss, state):
    """The batch loss on every rank: held by the last stage, averaged over dp."""
    held = torch.zeros(2, device=state.device)  # (loss, 1) on ranks holding it, else zeros
    if model.has_last_stage and loss is not None:
        held[0], held[1] = loss.detach().reshape(()), 1.0
    dist.all_reduce(held, group=state.pp_group)  # the last stage's rank; DualPipe: both end ranks
    value = held[0] / held[1]
    if state.tp > 1:
        value /= state.tp  # every TP rank of the last stage holds the same loss
        dist.all_reduce(value, group=state.tp_group)
    dist.all_reduce(value, group=state.dp_group)
    return value.item() / state.dp


def main():
    args = parse_args()
    state = torchpp.init_parallel(tp=args.tp, pp=args.pp, cp=args.cp)
    torch.set_num_threads(1)
    rank = dist.get_rank()
    if args.batch % state.dp:
        raise SystemExit(f"--batch {args.batch} is not divisible by the data-parallel size {state.dp}")
    if args.init_from:
        config = AutoConfig.from_pretrained(args.init_from)
        with torch.device("meta"):  # no rank ever holds the whole model
            hf_model = AutoModelForCausalLM.from_config(config)
    else:
        config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=args.seq)
        torch.manual_seed(args.seed)  # the same initial model on every rank; parallelize keeps our shards
        hf_model = LlamaForCausalLM(config)
    # One skip decision and one scale on every rank; disabled (a no-op) unless --fp16.
    scaler = GradScaler(state.device.type, enabled=args.fp16)
    model = parallelize(hf_model, schedule=args.schedule, n_microbatches=args.microbatches,
                        recompute=args.recompute, state=state, grad_scaler=scaler, zero=args.zero)
    del hf_model
    if args.init_from:
        load_hf_weights(model, args.init_from)
    model_parallel_manual_seed(args.seed, tp_rank=state.tp_rank, pp_rank=state.pp_rank)
    optimizer = DistributedOptimizer(model, torch.optim.AdamW, state, max_norm=1.0,
                                     accumulations_per_step=args.microbatches, lr=args.lr, grad_scaler=scaler,
                                     post_validate=args.post_validate,
                                     hold=[model.tied_weight] if model.tied_weight is not None else [])
    data = torch.Generator().manual_seed(args.seed + state.dp_rank)  # each replica its own data
    local_batch = args.batch // state.dp

    if rank == 0:
        print(f"world={dist.get_world_size()} tp={state.tp} pp={state.pp} cp={state.cp} dp={state.dp} "
              f"schedule={args.schedule} "
              f"microbatches={args.microbatches} zero={args.zero} recompute={args.recompute} bf16={args.bf16} "
              f"fp16={args.fp16} post_validate={args.post_validate} "
              f"params/rank={sum(p.numel() for p in model.parameters())}", flush=True)
    # Bar and per-step lines share stdout (the lines go through the bar's write, which clears and
    # redraws it); when stdout is not a terminal (a log, a pipe) the lines alone are printed.
    bar = tqdm(range(1, args.steps + 1), disable=rank != 0 or not sys.stdout.isatty(), desc="train", unit="step",
               file=sys.stdout)
    reruns = 0
    for step in bar:
        start = time.perf_counter()
        ids = progression_batch(data, local_batch, args.seq, config.vocab_size).to(state.device)
        while True:  # post-validation re-runs a batch computed from an update it then undid
            optimizer.zero_grad()
            with torch.autocast(state.device.type, dtype=torch.float16 if args.fp16 else torch.bfloat16,
                                enabled=args.bf16 or args.fp16):
                loss = model.step(ids if model.has_first_stage else None,
                                  labels=ids if model.has_last_stage else None)
            norm = optimizer.step()  # post-validation: the previous step's norm (None at first)
            if not optimizer.rerun:
                break
            reruns += 1
        value = step_loss(model, loss, state)
        tokens_per_s = args.batch * args.seq / (time.perf_counter() - start)
        if rank == 0:
            bar.set_postfix(loss=f"{value:.3f}", tok_s=f"{tokens_per_s:.0f}")
            extra = f"  loss-scale {scaler.get_scale():.0f}" if args.fp16 else ""
            if args.post_validate:  # a skip shows as a re-run, settled a step later
                extra += f"  re-runs {reruns}"
            elif args.fp16 and optimizer.last_step_skipped:
                extra += " (skipped)"
            grad_norm = "pending" if norm is None else f"{norm.item():.3f}"
            bar.write(f"step {step:3d}  loss {value:.4f}  grad-norm {grad_norm}{extra}  "
                      f"tokens/s {tokens_per_s:7.0f}", file=sys.stdout)
            sys.stdout.flush()
    if args.post_validate:
        optimizer.flush()  # settles the last update
    if args.save_hf:
        optimizer.gather_params()  # ZeRO-3 holds only shards between steps
        save_hf_checkpoint(model, args.save_hf)
        if rank == 0:
            print(f"wrote the transformers checkpoint {args.save_hf}")

    if model.schedule is not None:
        os.makedirs(args.out, exist_ok=True)
        trace = export_chrome_trace(model.schedule, os.path.join(args.out, "trace.json"))
        picture = plot_timeline(model.schedule, os.path.join(args.out, "timeline.png"))
        runs = gather_runs(model.schedule)
        if rank == 0:
            measured = measured_simulation(model.schedule, runs)
            costs = measured_costs(measured)
            predicted = predicted_simulation(measured).bubble_ratio
            stages = ", ".join(f"F {f:.2f} I {i:.2f} W {w:.2f}" for f, i, w in zip(costs["f"], costs["i"], costs["w"]))
            print(f"measured bubble ratio (last step) {measured.bubble_ratio:.3f}; simulator from the measured "
                  f"per-stage costs {predicted:.3f} (ms per stage: {stages}; no transfer latency); peak live "
                  f"activations per pp rank {measured.peak_activations}")
            print(f"wrote {trace} and {picture}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
