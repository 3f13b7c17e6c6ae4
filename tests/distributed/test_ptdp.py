"""PTD-P end to end: the Megatron-style GPT over dp x pp x tp with real schedules, DP gradient
reduction or ZeRO-1, and global-norm clipping, for 3 AdamW steps: the losses equal one process
training the same model on the full batch (fp32, rtol 1e-5)."""
import pytest
import torch
import torch.distributed as dist

from torchpp import schedule as S
from torchpp.models.gpt import GPT, GPTConfig, gpt_loss
from torchpp.parallel import DistributedOptimizer, finalize_grads, init_parallel
from torchpp.pipeline import PipelineStage, build_schedule, split_model
from tp_reference import singleton_group, train_reference

BATCH, MICROBATCHES, STEPS, MAX_NORM, LR = 8, 4, 3, 0.5, 1e-2
CHUNKS = {"interleaved-1f1b": 2, "zb-v": 2}
ZERO_BUBBLE = ("zb-h1", "zb-h2", "zb-v", "zb-auto")


def _config(schedule):
    return GPTConfig(vocab_size=32, hidden_size=16, num_heads=4, num_layers=6, max_seq_len=8,
                     split_bw=schedule in ZERO_BUBBLE)


def _data():
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 32, (BATCH, 8), generator=g)
    labels = torch.randint(0, 32, (BATCH, 8), generator=g)
    return tokens, labels


def _reference_losses(schedule):
    alone = singleton_group()
    torch.manual_seed(11)
    model = GPT(_config(schedule), group=alone)
    tokens, labels = _data()
    return train_reference(model, tokens, labels, alone, STEPS, LR, MAX_NORM)[0]


def train_ptdp(dp, pp, tp, schedule, zero):
    """Trains on this rank's part of the layout; returns the per-step losses (last stage) or None."""
    state = init_parallel(tp=tp, pp=pp, dp=dp)
    torch.manual_seed(11)  # full weights identical to the reference's on every rank
    model = GPT(_config(schedule), group=state.tp_group)
    chunks = CHUNKS.get(schedule, 1)
    compiled = S.generate(schedule, num_ranks=pp, num_microbatches=MICROBATCHES, num_chunks=chunks)
    parts = split_model(model, pp * chunks)
    mine = sorted({compiled.model_stage(s) for s, r in enumerate(compiled.stage_to_rank) if r == state.pp_rank})
    stages = [PipelineStage(parts[i], i, pp * chunks, torch.device("cpu"), group=state.pp_group, tp_group=state.tp_group)
              for i in mine]
    params = [p for i in mine for p in parts[i].parameters()]
    pipeline = build_schedule(schedule, stages, MICROBATCHES,
                              loss_fn=lambda logits, labels: gpt_loss(logits, labels, state.tp_group))
    optimizer = DistributedOptimizer(params, torch.optim.AdamW, state, zero=zero, max_norm=MAX_NORM,
                                     accumulations_per_step=MICROBATCHES, bucket_bytes=2048, lr=LR)
    tokens, labels = _data()
    rows = slice(state.dp_rank * BATCH // dp, (state.dp_rank + 1) * BATCH // dp)
    holds_last = any(i == pp * chunks - 1 for i in mine)
    step_losses = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        losses = []
        pipeline.step(*([tokens[rows]] if 0 in mine else []), target=labels[rows] if holds_last else None, losses=losses)
        finalize_grads([parts[i] for i in mine], state)
        optimizer.step()
        if holds_last:
            step_loss = torch.stack(losses).mean()
            dist.all_reduce(step_loss, group=state.dp_group)
            step_losses.append(step_loss / dp)
    return torch.stack(step_losses) if holds_last else None


def check_layout(dp, pp, tp, schedules, zeros):
    for schedule in schedules:
        reference = _reference_losses(schedule)
        for zero in zeros:
            losses = train_ptdp(dp, pp, tp, schedule, zero)
            if losses is not None:
                torch.testing.assert_close(
                    losses, reference, rtol=1e-5, atol=1e-6,
                    msg=lambda m: f"dp={dp} pp={pp} tp={tp} {schedule} zero={zero}: {m}",
                )
    return True


SCHEDULES = ["1f1b", "interleaved-1f1b", "zb-h1", "zb-v"]


@pytest.mark.parametrize(
    "dp,pp,tp,schedules",
    [
        (2, 1, 1, ["1f1b"]),
        (1, 2, 2, SCHEDULES),
        (2, 2, 1, SCHEDULES),
        (2, 2, 2, ["1f1b", "zb-h1"]),
    ],
)
def test_ptdp_matches_single_process(ranks, dp, pp, tp, schedules):
    world = dp * pp * tp
    assert ranks(world).run(check_layout, dp, pp, tp, schedules, (False, True), timeout=400) == [True] * world
