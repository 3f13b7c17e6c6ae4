"""A wrapped HF GPT-2 trained with dp=2 x pp=2 and the DistributedOptimizer (with and without
ZeRO-1, with clipping): 3 AdamW steps give the losses of the unwrapped model trained in one
process on the full batch (and so does a Llama with one key/value head at dp=2 x tp=2). Under zb-h1 the tied embeddings are on different stages; under
DualPipe every rank holds two stages, each stage is on two ranks (the gradient norm counts it
once), and both end ranks hold the tied pair and the batch loss."""
import copy

import torch
import torch.distributed as dist

import torchpp
from torchpp.models import parallelize
from torchpp.parallel import DistributedOptimizer
from hf_reference import tiny_model

STEPS, LR, MAX_NORM, ROWS = 3, 1e-2, 0.5, 8
MICROBATCHES = {"zb-h1": 2, "dualpipe": 4}  # DualPipe needs m >= 2p


def _ids(vocab):
    g = torch.Generator().manual_seed(5)
    return torch.randint(0, vocab, (ROWS, 8), generator=g)


def _reference(model):
    """Each step's loss and gradient norm before clipping."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    ids = _ids(model.config.vocab_size)
    losses, norms = [], []
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
        optimizer.step()
        losses.append(loss.detach())
    return torch.stack(losses), torch.stack(norms)


def check_data_parallel(kind, schedule, zero, tp=1, pp=2, kv_heads=2):
    state = torchpp.init_parallel(tp=tp, pp=pp, dp=2)
    model = tiny_model(kind, kv_heads=kv_heads)
    what = f"{kind} dp=2 tp={tp} pp={pp} {schedule} zero={zero} kv_heads={kv_heads}"
    reference, reference_norms = _reference(copy.deepcopy(model))
    wrapped = parallelize(model, schedule=schedule, n_microbatches=MICROBATCHES.get(schedule, 1), state=state)
    if kind == "gpt2":  # zb-h1: embedding on stage 0, head on stage 1 (two copies); DualPipe: both on each end rank
        assert (wrapped.tied_weight is None) == (schedule == "dualpipe")
    hold = [wrapped.tied_weight] if wrapped.tied_weight is not None else []
    # Under DualPipe each copy of a stage runs its pipeline's half of the microbatches, and the
    # twin copies' gradients are summed after backward: the reducer must wait for that sum.
    accumulations = MICROBATCHES.get(schedule, 1) // (2 if schedule == "dualpipe" else 1)
    optimizer = DistributedOptimizer(wrapped.parameters(), torch.optim.AdamW, state, zero=zero, max_norm=MAX_NORM,
                                     accumulations_per_step=accumulations, hold=hold, bucket_bytes=4096, lr=LR)
    ids = _ids(model.config.vocab_size)
    rows = ids.chunk(state.dp)[state.dp_rank]
    losses, norms = [], []
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = wrapped.step(rows if wrapped.has_first_stage else None, labels=rows if wrapped.has_last_stage else None)
        norms.append(optimizer.step())
        if wrapped.has_last_stage:
            dist.all_reduce(loss, group=state.dp_group)
            losses.append(loss / state.dp)
    if wrapped.has_last_stage:
        torch.testing.assert_close(torch.stack(losses), reference, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{what}: {m}")
    # Adam all but ignores a constant gradient factor, so the norm is checked directly: every
    # rank's equals the whole model's, each parameter counted once.
    torch.testing.assert_close(torch.stack(norms).float(), reference_norms, rtol=1e-5, atol=1e-6,
                               msg=lambda m: f"{what} norms: {m}")
    assert reference_norms.max() > MAX_NORM, reference_norms  # and clipping is in force
    return True


def check_all():
    return all(check_data_parallel("gpt2", schedule, zero) for schedule in ("zb-h1", "dualpipe") for zero in (False, True))


def check_kv_copies():
    """dp=2 x tp=2, one key/value head copied onto both TP ranks: the reducer waits for the
    copies' sum, and the norm counts the head once."""
    return all(check_data_parallel("llama", "1f1b", zero, tp=2, pp=1, kv_heads=1) for zero in (False, True))


def test_wrapped_gpt2_data_parallel_pipeline(ranks):
    assert ranks(4).run(check_all, timeout=300) == [True] * 4


def test_data_parallel_with_kv_heads_copied_over_tp(ranks):
    assert ranks(4).run(check_kv_copies, timeout=300) == [True] * 4
