"""Activation recomputation (full and selective) leaves gradients unchanged, with dropout on:
the recomputed forward replays the default and the tensor-parallel RNG streams."""
import torch

import torchpp
import torchpp.tensor_parallel as tp
from torchpp.models import parallelize
from hf_reference import batch, tiny_model

TIMEOUT_S = 150
MODES = (None, "full", "selective")


def _grads_and_loss(kind, recompute, state, seed=3, **options):
    model = tiny_model(kind, dropout=0.2)
    wrapped = parallelize(model, recompute=recompute, state=state, **options)
    ids, labels = batch(model.config.vocab_size)
    tp.model_parallel_manual_seed(seed, tp_rank=state.tp_rank, pp_rank=state.pp_rank)
    loss = wrapped.step(ids, labels)
    grads = {name: p.grad.clone() for name, p in wrapped.named_parameters()}
    return grads, loss


def _assert_identical(kind, state, **options):
    baseline, loss = _grads_and_loss(kind, None, state, **options)
    # Dropout is live (another seed changes the gradients), so a mask mismatch would show.
    other_seed, _ = _grads_and_loss(kind, None, state, seed=4, **options)
    assert any(not torch.equal(baseline[n], other_seed[n]) for n in baseline), f"{kind}: dropout had no effect"
    for mode in MODES[1:]:
        grads, mode_loss = _grads_and_loss(kind, mode, state, **options)
        assert (loss is None) == (mode_loss is None)
        if loss is not None:
            assert torch.equal(mode_loss, loss), f"{kind} recompute={mode} {options}: loss {mode_loss} != {loss}"
        assert grads.keys() == baseline.keys()
        for name, grad in grads.items():
            assert torch.equal(grad, baseline[name]), f"{kind} recompute={mode} {options}: grad of {name} differs"


def check_tp_recompute():
    state = torchpp.init_parallel(tp=2, pp=1)
    _assert_identical("gpt2", state)
    _assert_identical("llama", state, sequence_parallel=True)
    return True


def check_pipeline_recompute():
    state = torchpp.init_parallel(tp=2, pp=2)
    # zb-h1 defers weight gradients (split B/W) past the recomputed backward.
    _assert_identical("gpt2", state, schedule="zb-h1", n_microbatches=4)
    _assert_identical("mistral", state, schedule="interleaved-1f1b", n_microbatches=4)
    return True


def test_recompute_keeps_gradients_tp2(ranks):
    assert ranks(2).run(check_tp_recompute, timeout=TIMEOUT_S) == [True, True]


def test_recompute_keeps_gradients_pp2_tp2(ranks):
    assert ranks(4).run(check_pipeline_recompute, timeout=TIMEOUT_S) == [True] * 4
