"""A wrapped HF GPT-2 (tied embeddings on different stages) trained with dp=2 x pp=2 and the
DistributedOptimizer (with and without ZeRO-1, with clipping): 3 AdamW steps give the losses
of the unwrapped model trained in one process on the full batch."""
import copy

import torch
import torch.distributed as dist

import torchpp
from torchpp.models import parallelize
from torchpp.parallel import DistributedOptimizer
from hf_reference import BATCH, tiny_model

STEPS, LR, MAX_NORM, MICROBATCHES = 3, 1e-2, 0.5, 2


def _ids(vocab):
    g = torch.Generator().manual_seed(5)
    return torch.randint(0, vocab, (BATCH, 8), generator=g)


def _reference_losses(model):
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    ids = _ids(model.config.vocab_size)
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
        losses.append(loss.detach())
    return torch.stack(losses)


def check_gpt2_dp_pp(zero):
    state = torchpp.init_parallel(tp=1, pp=2, dp=2)
    model = tiny_model("gpt2")
    reference = _reference_losses(copy.deepcopy(model))
    wrapped = parallelize(model, schedule="zb-h1", n_microbatches=MICROBATCHES, state=state)
    assert wrapped.tied_weight is not None  # embedding on stage 0, head on stage 1
    optimizer = DistributedOptimizer(wrapped.parameters(), torch.optim.AdamW, state, zero=zero, max_norm=MAX_NORM,
                                     accumulations_per_step=MICROBATCHES, hold=[wrapped.tied_weight],
                                     bucket_bytes=4096, lr=LR)
    ids = _ids(model.config.vocab_size)
    rows = ids.chunk(state.dp)[state.dp_rank]
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = wrapped.step(rows if wrapped.has_first_stage else None, labels=rows if wrapped.has_last_stage else None)
        optimizer.step()
        if wrapped.has_last_stage:
            dist.all_reduce(loss, group=state.dp_group)
            losses.append(loss / state.dp)
    if wrapped.has_last_stage:
        torch.testing.assert_close(torch.stack(losses), reference, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"gpt2 dp=2 pp=2 zero={zero}: {m}")
    return True


def check_both():
    return check_gpt2_dp_pp(False) and check_gpt2_dp_pp(True)


def test_wrapped_gpt2_data_parallel_pipeline(ranks):
    assert ranks(4).run(check_both, timeout=300) == [True] * 4
