"""torchpp main job: a Llama from transformers trained with PTD-P on real text, resumable.

    torchrun --nproc-per-node 4 examples/train_llama.py            # pp=2 x tp=2, zb-h1
    torchrun --nproc-per-node 8 examples/train_llama.py            # pp=2 x tp=2 x dp=2
    torchrun --nproc-per-node 4 examples/train_llama.py --zero --schedule interleaved-1f1b  # --zero 2 / --zero 3: ZeRO-2/3
    torchrun --nproc-per-node 4 examples/train_llama.py --schedule dualpipe --microbatches 4
    torchrun --nproc-per-node 4 examples/train_llama.py --fp16     # fp16 autocast, dynamic loss scaling
    torchrun --nproc-per-node 4 examples/train_llama.py --fp16 --post-validate   # no wait for norm/inf checks
    torchrun --nproc-per-node 4 examples/train_llama.py --data my_texts/ --tokenizer my_tokenizer/
    torchrun --nproc-per-node 4 examples/train_llama.py --save-hf runs/hf          # then from_pretrained reads it
    torchrun --nproc-per-node 4 examples/train_llama.py --init-from runs/hf        # fine-tune a checkpoint
    torchrun --nproc-per-node 4 --max-restarts 3 examples/train_llama.py          # a dead rank costs no steps

The text is CPython's documentation topics (shipped with Python; no download) or --data,
tokenized by a byte-level BPE trained at first use and cached (or --tokenizer), packed into
rows whose position ids restart at each document; a held-out share of the documents gives the
eval loss. The model is a small random LlamaForCausalLM, or --init-from any causal LM folder
(built on the meta device, each rank loading only its shards). torchpp.models.parallelize
shards it over tp and cuts it into pp stages run by the schedule; the DistributedOptimizer
reduces over dp (or shards, --zero) and clips. Checkpoints (model, optimizer, LR schedule,
data position, RNG, step) go to --checkpoint-dir every --checkpoint-every steps, written in
the background; a job started again on that directory resumes from the latest one by itself.
Figures per step go to stdout, metrics.jsonl and TensorBoard; the last step's Chrome trace,
its timeline and the loss curves go to --out. See docs/training.md. Runs on GPUs unchanged.
"""
import argparse
import math
import os
import sys

import torch
import torch.distributed as dist
from tqdm import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import torchpp
from torchpp.data import PackedLoader, prepare_text
from torchpp.models import load_hf_weights, parallelize, save_hf_checkpoint
from torchpp.parallel import DistributedOptimizer, GradScaler
from torchpp.pipeline import export_chrome_trace, plot_timeline
from torchpp.pipeline.trace import gather_runs, measured_costs, measured_simulation, predicted_simulation
from torchpp.tensor_parallel import model_parallel_manual_seed
from torchpp.training import (CheckpointLoop, MetricsLog, StepTimer, measure_matmul_tflops, peak_memory_bytes,
                              pipeline_bubble, plot_losses, training_flops_per_token)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    layout = parser.add_argument_group("parallel layout")
    layout.add_argument("--tp", type=int, default=2, help="tensor-parallel size")
    layout.add_argument("--pp", type=int, default=2, help="pipeline-parallel size (dp = world / (tp*pp*cp))")
    layout.add_argument("--cp", type=int, default=1, help="context-parallel size: each sequence split over cp ranks")
    layout.add_argument("--cp-mode", choices=("ring", "all-gather", "all-to-all", "all-to-all+ring"), default="ring",
                        help="how attention reaches the other cp ranks' keys: passed around a ring, all-gathered, "
                             "heads traded for the sequence (all-to-all, DeepSpeed-Ulysses: cp must divide the heads), "
                             "or both (all-to-all inside groups of --cp-all-to-all-size ranks, the ring across them)")
    layout.add_argument("--cp-all-to-all-size", type=int, default=None,
                        help="with --cp-mode all-to-all+ring: consecutive cp ranks per all-to-all group (one node's)")
    layout.add_argument("--schedule", default="zb-h1", help="any torchpp.schedule name")
    layout.add_argument("--microbatches", type=int, default=4)
    layout.add_argument("--zero", type=int, nargs="?", const=1, default=0, choices=(0, 1, 2, 3),
                        help="ZeRO stage over dp: 1 (the flag alone) shards Adam's state, 2 the gradients too, "
                             "3 the weights too")
    layout.add_argument("--recompute", choices=["full", "selective"], default=None)
    precision = parser.add_mutually_exclusive_group()
    precision.add_argument("--bf16", action="store_true", help="mixed precision: the step under torch.autocast(bf16)")
    precision.add_argument("--fp16", action="store_true",
                           help="mixed precision: torch.autocast(fp16) with dynamic loss scaling (GradScaler)")
    parser.add_argument("--post-validate", action="store_true",
                        help="optimizer post-validation: update without waiting for the global norm (and the fp16 "
                             "inf check); an update that should have been clipped or skipped is redone and the "
                             "batch after it runs again")
    data = parser.add_argument_group("data")
    data.add_argument("--data", default=None, help="a .txt/.jsonl/.parquet file or a folder of them (default: "
                                                   "CPython's documentation topics)")
    data.add_argument("--text-field", default="text", help="the text column of .jsonl/.parquet files")
    data.add_argument("--tokenizer", default=None, help="a local transformers tokenizer folder (default: a byte-level "
                                                        "BPE trained on the text at first use, then cached)")
    data.add_argument("--vocab-size", type=int, default=4096, help="the trained BPE's vocabulary size")
    data.add_argument("--held-out", type=float, default=0.1, help="fraction of documents held out for eval")
    data.add_argument("--seq", type=int, default=128, help="tokens per packed row")
    data.add_argument("--batch", type=int, default=16, help="global batch (rows)")
    model = parser.add_argument_group("model (a random Llama; ignored with --init-from)")
    model.add_argument("--hidden", type=int, default=128)
    model.add_argument("--layers", type=int, default=4)
    model.add_argument("--heads", type=int, default=4)
    model.add_argument("--kv-heads", type=int, default=2)
    model.add_argument("--ffn", type=int, default=384)
    model.add_argument("--init-from", default=None,
                       help="a transformers checkpoint folder (save_pretrained's) to start from; its tokenizer too, "
                            "when the folder holds one")
    train = parser.add_argument_group("training")
    train.add_argument("--steps", type=int, default=200, help="train until this step (a resumed run continues to it)")
    train.add_argument("--lr", type=float, default=3e-3)
    train.add_argument("--warmup", type=int, default=20, help="linear LR warm-up steps, then cosine to lr/10")
    train.add_argument("--seed", type=int, default=1234)
    train.add_argument("--eval-every", type=int, default=25, help="held-out loss every N steps (0: only at the end)")
    train.add_argument("--eval-batches", type=int, default=4, help="held-out batches per evaluation")
    ckpt = parser.add_argument_group("checkpoints")
    ckpt.add_argument("--checkpoint-dir", default=None,
                      help="where checkpoints go and resume from (default: OUT/checkpoints; 'none': no checkpoints)")
    ckpt.add_argument("--checkpoint-every", type=int, default=50, help="save every N steps (and after the last)")
    ckpt.add_argument("--sync-checkpoint", action="store_true", help="save in the training loop, not in the background")
    ckpt.add_argument("--no-verify", action="store_true", help="resume without checking the checkpoint's checksums")
    out = parser.add_argument_group("output")
    out.add_argument("--out", default="runs/llama", help="metrics.jsonl, trace.json, timeline.png and loss.png go here")
    out.add_argument("--tensorboard", default=None, help="TensorBoard event files (default: OUT/tensorboard; 'none': off)")
    out.add_argument("--peak-tflops", type=float, default=None,
                     help="each rank's peak TFLOP/s for MFU (default: a matmul measured on each rank at start)")
    out.add_argument("--save-hf", default=None, help="write the trained model (and tokenizer) here as a transformers "
                                                     "checkpoint")
    args = parser.parse_args()
    args.checkpoint_dir = _or_default(args.checkpoint_dir, os.path.join(args.out, "checkpoints"))
    args.tensorboard = _or_default(args.tensorboard, os.path.join(args.out, "tensorboard"))
    return args


def _or_default(value, default):
    return default if value is None else (None if value.lower() == "none" else value)


def build_model(args, vocab_size):
    """The transformers model to wrap: --init-from's (on the meta device) or a random Llama."""
    if args.init_from:
        config = AutoConfig.from_pretrained(args.init_from)
        if config.vocab_size < vocab_size:
            raise SystemExit(f"--init-from {args.init_from} has {config.vocab_size} token embeddings, the tokenizer "
                             f"{vocab_size} tokens: pass its own --tokenizer")
        with torch.device("meta"):  # no rank ever holds the whole model
            return AutoModelForCausalLM.from_config(config)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=args.hidden, intermediate_size=args.ffn,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=args.seq, tie_word_embeddings=False)
    torch.manual_seed(args.seed)  # the same initial model on every rank; parallelize keeps our shards
    return LlamaForCausalLM(config)


def warmup_cosine(warmup, steps):
    """LR multiplier of update k (0-based): linear warm-up, then cosine from 1 to 0.1 at `steps`."""
    def factor(k):
        if k < warmup:
            return (k + 1) / warmup
        return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, (k - warmup) / max(1, steps - warmup))))
    return factor


def batch_loss(model, loss, state):
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


def run_batch(model, batch, state, args, evaluate=False):
    """One batch through the pipeline: forward and backward (or forward only, to evaluate)."""
    ids = batch.input_ids.to(state.device)
    positions = batch.position_ids.to(state.device)  # restart at each packed document
    with torch.autocast(state.device.type, dtype=torch.float16 if args.fp16 else torch.bfloat16,
                        enabled=args.bf16 or args.fp16):
        run = model.eval_step if evaluate else model.step
        return run(ids if model.has_first_stage else None, labels=ids if model.has_last_stage else None,
                   position_ids=positions if model.has_first_stage else None)


def held_out_loss(model, batches, state, args):
    """The mean loss over the held-out batches, through the pipeline's eval step."""
    model.eval()
    with torch.no_grad():
        value = sum(batch_loss(model, run_batch(model, b, state, args, evaluate=True), state) for b in batches)
    model.train()
    return value / len(batches)


def main():
    args = parse_args()
    state = torchpp.init_parallel(tp=args.tp, pp=args.pp, cp=args.cp)
    torch.set_num_threads(1)
    rank = dist.get_rank()
    say = print if rank == 0 else (lambda *a, **k: None)

    # Data: prepared on rank 0 (documents, tokenizer, packing), the same rows on every rank.
    text = prepare_text(args.seq, data=args.data, tokenizer=args.tokenizer or _tokenizer_of(args.init_from),
                        vocab_size=args.vocab_size, held_out=args.held_out, text_field=args.text_field)
    say(text.description, flush=True)
    loader = PackedLoader(text.train, args.batch, seed=args.seed, dp_rank=state.dp_rank, dp_size=state.dp)
    eval_batches = PackedLoader(text.held_out, args.batch, dp_rank=state.dp_rank, dp_size=state.dp,
                                shuffle=False).first_batches(args.eval_batches)

    # Model and optimizer.
    hf_model = build_model(args, text.vocab_size)
    flops_per_token = training_flops_per_token(hf_model, args.seq)
    scaler = GradScaler(state.device.type, enabled=args.fp16)  # one skip decision for all ranks; off unless --fp16
    model = parallelize(hf_model, schedule=args.schedule, n_microbatches=args.microbatches,
                        recompute=args.recompute, state=state, grad_scaler=scaler, zero=args.zero,
                        cp_mode=args.cp_mode, cp_all_to_all_size=args.cp_all_to_all_size)
    del hf_model
    if args.init_from:
        load_hf_weights(model, args.init_from)
    model_parallel_manual_seed(args.seed, tp_rank=state.tp_rank, pp_rank=state.pp_rank)
    optimizer = DistributedOptimizer(model, torch.optim.AdamW, state, max_norm=1.0,
                                     accumulations_per_step=args.microbatches, lr=args.lr, grad_scaler=scaler,
                                     post_validate=args.post_validate,
                                     hold=[model.tied_weight] if model.tied_weight is not None else [])
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer.torch_optimizer, warmup_cosine(args.warmup, args.steps))

    # Resume from the latest checkpoint, if the directory holds one.
    checkpoints = None
    start = 0
    if args.checkpoint_dir:
        checkpoints = CheckpointLoop(args.checkpoint_dir, args.checkpoint_every, model, optimizer,
                                     stateful={"data": loader, "lr_schedule": schedule},
                                     asynchronous=not args.sync_checkpoint, verify=not args.no_verify)
        start = checkpoints.resume() or 0
        say(f"resumed from {args.checkpoint_dir} at step {start} (model, optimizer, LR schedule, data position "
            f"epoch {loader.epoch} batch {loader.batch}, RNG)" if start else
            f"no checkpoint in {args.checkpoint_dir}: starting at step 0", flush=True)

    # Figures: MFU against --peak-tflops or a matmul measured on every rank (their median).
    compute_dtype = torch.float16 if args.fp16 else torch.bfloat16 if args.bf16 else torch.float32
    peak = torch.tensor(args.peak_tflops or measure_matmul_tflops(state.device, compute_dtype), dtype=torch.float64)
    if args.peak_tflops is None:
        peaks = [torch.zeros_like(peak) for _ in range(dist.get_world_size())]
        dist.all_gather(peaks, peak)
        peak = torch.stack(peaks).median()
    timer = StepTimer(args.batch * args.seq, flops_per_token, peak.item() * 1e12 * dist.get_world_size())
    log = MetricsLog(os.path.join(args.out, "metrics.jsonl"), args.tensorboard, start) if rank == 0 else None
    cp_how = "" if state.cp == 1 else f" ({args.cp_mode}" + (
        f", all-to-all groups of {args.cp_all_to_all_size})" if args.cp_all_to_all_size else ")")
    say(f"world={dist.get_world_size()} tp={state.tp} pp={state.pp} cp={state.cp}{cp_how} dp={state.dp} "
        f"schedule={args.schedule} microbatches={args.microbatches} zero={args.zero} recompute={args.recompute} "
        f"bf16={args.bf16} fp16={args.fp16} post_validate={args.post_validate} "
        f"params/rank={sum(p.numel() for p in model.parameters())} model TFLOP/token={flops_per_token / 1e12:.2e} "
        f"peak {peak.item():.2f} TFLOP/s per rank ({'given' if args.peak_tflops else 'measured matmul'})", flush=True)

    # Bar and per-step lines share stdout (the lines go through the bar's write, which clears and
    # redraws it); when stdout is not a terminal (a log, a pipe) the lines alone are printed.
    bar = tqdm(range(start + 1, args.steps + 1), disable=rank != 0 or not sys.stdout.isatty(), desc="train",
               unit="step", file=sys.stdout, initial=start, total=args.steps)
    if start == 0 and args.steps > 0:  # where the held-out loss starts from
        before = held_out_loss(model, eval_batches, state, args)
        if log is not None:
            log.write(0, eval_loss=before)
            bar.write(f"held-out loss {before:.4f} at step 0 ({len(eval_batches)} batches of {args.batch} x "
                      f"{args.seq} tokens)", file=sys.stdout)
    reruns = 0
    for step in bar:
        batch = next(loader)
        timer.start()
        while True:  # post-validation re-runs a batch computed from an update it then undid
            optimizer.zero_grad()
            loss = run_batch(model, batch, state, args)
            norm = optimizer.step()  # post-validation: the previous step's norm (None at first)
            if not optimizer.rerun:
                break
            reruns += 1
        schedule.step()
        value = batch_loss(model, loss, state)
        timer.stop()
        figures = dict(loss=value, lr=schedule.get_last_lr()[0], tokens_per_s=timer.tokens_per_s, mfu=timer.mfu,
                       step_s=timer.seconds, peak_memory_mib=[b / 2**20 for b in peak_memory_bytes(state.device)])
        if model.schedule is not None:
            figures["bubble"] = pipeline_bubble(model.schedule)
        if norm is not None:
            figures["grad_norm"] = norm.item()
        if (args.eval_every and step % args.eval_every == 0) or step == args.steps:
            if args.post_validate:
                optimizer.flush()  # evaluate the settled parameters
            figures["eval_loss"] = held_out_loss(model, eval_batches, state, args)
        saved = checkpoints.after_step(step, last=step == args.steps) if checkpoints else False
        if rank == 0:
            bar.set_postfix(loss=f"{value:.3f}", tok_s=f"{timer.tokens_per_s:.0f}")
            extra = f"  loss-scale {scaler.get_scale():.0f}" if args.fp16 else ""
            if args.post_validate:  # a skip shows as a re-run, settled a step later
                extra += f"  re-runs {reruns}"
            elif args.fp16 and optimizer.last_step_skipped:
                extra += " (skipped)"
            grad_norm = "pending" if norm is None else f"{norm.item():.3f}"
            bubble = f"  bubble {figures['bubble']:.3f}" if "bubble" in figures else ""
            bar.write(f"step {step:4d}  loss {value:.4f}  grad-norm {grad_norm}  lr {figures['lr']:.2e}  "
                      f"tokens/s {timer.tokens_per_s:6.0f}  MFU {timer.mfu:6.2%}  "
                      f"peak-mem {max(figures['peak_memory_mib']):.0f} MiB{bubble}{extra}", file=sys.stdout)
            if "eval_loss" in figures:
                bar.write(f"held-out loss {figures['eval_loss']:.4f} at step {step} ({len(eval_batches)} batches of "
                          f"{args.batch} x {args.seq} tokens)", file=sys.stdout)
            if saved:
                bar.write(f"checkpoint step {step} -> {args.checkpoint_dir} (training held {checkpoints.stall_s:.3f}s"
                          f"{', written in the background' if not args.sync_checkpoint else ''})", file=sys.stdout)
            sys.stdout.flush()
            log.write(step, **figures, **({"checkpoint_stall_s": checkpoints.stall_s} if saved else {}))
    if start >= args.steps:
        say(f"the checkpoint is at step {start}, and --steps is {args.steps}: nothing left to train (pass a larger "
            f"--steps to train on, or another --checkpoint-dir to start over)")
    if args.post_validate:
        optimizer.flush()  # settles the last update
    if checkpoints is not None:
        checkpoints.close()  # the last save is committed
    if args.save_hf:
        optimizer.gather_params()  # ZeRO-3 holds only shards between steps
        save_hf_checkpoint(model, args.save_hf)
        if rank == 0 and text.tokenizer is not None:
            text.tokenizer.save_pretrained(args.save_hf)  # --init-from then finds the same tokenizer
        say(f"wrote the transformers checkpoint {args.save_hf}")

    if model.schedule is not None and start < args.steps:
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
    if log is not None:
        log.close()
        title = f"{type(model).__name__}, pp={state.pp} x tp={state.tp} x dp={state.dp}, {args.schedule}"
        print(f"wrote {plot_losses(log.path, os.path.join(args.out, 'loss.png'), title)} and {log.path}"
              + (f"; TensorBoard: tensorboard --logdir {args.tensorboard}" if args.tensorboard else ""))
    dist.destroy_process_group()


def _tokenizer_of(folder):
    """--init-from's own tokenizer, when its folder holds one."""
    return folder if folder and os.path.isfile(os.path.join(folder, "tokenizer_config.json")) else None


if __name__ == "__main__":
    main()
