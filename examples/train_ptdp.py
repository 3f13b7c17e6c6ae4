"""torchpp demo: train a small GPT with pipeline x tensor (x data) parallelism on CPU ranks.

    torchrun --nproc-per-node 4 examples/train_ptdp.py                  # pp=2 x tp=2, zb-h1
    torchrun --nproc-per-node 4 examples/train_ptdp.py --schedule 1f1b  # any torchpp.schedule name
    torchrun --nproc-per-node 2 examples/train_ptdp.py --pp 1 --tp 2    # tp only

Each pipeline stage is a slice of one Megatron-style GPT (embedding, blocks, head) whose
linears are tensor-parallel split-B/W layers, so zero-bubble schedules run weight gradients
in their own W passes. The task is synthetic and learnable (arithmetic progressions modulo
the vocabulary), so the loss falls quickly. The last step's real-run Chrome trace (all ranks
in one file, chrome://tracing or Perfetto) and its timeline picture go to --out.
"""
import argparse
import os
import time

import torch
import torch.distributed as dist

import torchpp.tensor_parallel as tp
from torchpp.models.gpt import GPT, GPTConfig, gpt_loss
from torchpp.parallel import finalize_grads, init_parallel
from torchpp.pipeline import PipelineStage, build_schedule, export_chrome_trace, plot_timeline, split_model


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=2, help="pipeline-parallel size")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size")
    parser.add_argument("--schedule", default="zb-h1", help="pipeline schedule (torchpp.schedule.SCHEDULES)")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--no-sp", action="store_true", help="disable sequence parallelism")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--out", default="runs/ptdp", help="directory for trace.json and timeline.png")
    return parser.parse_args()


def progression_batch(generator, batch, seq, vocab):
    """Sequences counting up from a random start by a random stride in 1..3 (mod vocab):
    inputs and next-token labels of length seq; learnable from the last two tokens."""
    start = torch.randint(0, vocab, (batch, 1), generator=generator)
    stride = torch.randint(1, 4, (batch, 1), generator=generator)
    tokens = (start + stride * torch.arange(seq + 1)) % vocab
    return tokens[:, :-1], tokens[:, 1:]


def average_over_dp(params, state):
    """Data parallelism: average this stage's gradients over its replicas."""
    if state.dp == 1:
        return
    grads = [p.grad for p in params]
    flat = torch._utils._flatten_dense_tensors(grads).div_(state.dp)
    dist.all_reduce(flat, group=state.dp_group)
    for grad, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
        grad.copy_(synced)


def main():
    args = parse_args()
    torch.set_num_threads(1)
    state = init_parallel(tp=args.tp, pp=args.pp, num_heads=4, num_layers=args.layers)
    sequence_parallel = not args.no_sp and args.tp > 1
    if args.batch % state.dp:
        raise SystemExit(f"--batch {args.batch} is not divisible by the data-parallel size {state.dp}")

    tp.model_parallel_manual_seed(args.seed, tp_rank=state.tp_rank)
    config = GPTConfig(vocab_size=64, hidden_size=args.hidden, num_heads=4, num_layers=args.layers,
                       max_seq_len=args.seq, split_bw=True)
    model = GPT(config, group=state.tp_group, sequence_parallel=sequence_parallel)
    stage_module = split_model(model, args.pp)[state.pp_rank]
    stage = PipelineStage(stage_module, state.pp_rank, args.pp, state.device, group=state.pp_group,
                          tp_group=state.tp_group)
    # Under sequence parallelism the stage outputs are already sharded over TP ranks, so each
    # TP rank sends its own shard; scatter/gather applies to TP-replicated outputs only.
    sched = build_schedule(args.schedule, stage, n_microbatches=args.microbatches,
                           loss_fn=lambda logits, labels: gpt_loss(logits, labels, state.tp_group),
                           scatter_gather=not sequence_parallel)
    params = list(stage_module.parameters())
    optimizer = torch.optim.AdamW(params, lr=args.lr)
    data = torch.Generator().manual_seed(args.seed + state.dp_rank)  # each replica its own data
    reporter = state.is_last_stage and state.tp_rank == 0 and state.dp_rank == 0

    if dist.get_rank() == 0:
        print(f"world={dist.get_world_size()} pp={args.pp} tp={args.tp} dp={state.dp} sp={sequence_parallel} "
              f"schedule={args.schedule} microbatches={args.microbatches}", flush=True)
    for step in range(1, args.steps + 1):
        start = time.perf_counter()
        inputs, labels = progression_batch(data, args.batch // state.dp, args.seq, config.vocab_size)
        optimizer.zero_grad(set_to_none=True)
        losses = []
        sched.step(inputs, target=labels, losses=losses)
        finalize_grads([stage_module], state)
        average_over_dp(params, state)
        optimizer.step()
        if reporter:
            loss = sum(losses).item() / len(losses)
            tokens_per_s = args.batch * args.seq / (time.perf_counter() - start)
            print(f"step {step:3d}  loss {loss:.4f}  tokens/s {tokens_per_s:8.0f}", flush=True)

    os.makedirs(args.out, exist_ok=True)
    trace = export_chrome_trace(sched, os.path.join(args.out, "trace.json"))
    picture = plot_timeline(sched, os.path.join(args.out, "timeline.png"))
    if trace:
        print(f"real-run trace of the last step: {trace} (chrome://tracing or ui.perfetto.dev)", flush=True)
        print(f"timeline picture: {picture}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
