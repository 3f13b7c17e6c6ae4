"""Gradient accumulation over several ``step`` calls of a parallelized transformers model: k
steps without zero_grad leave the sum of the k batches' gradients, as k backwards of the
unwrapped model do. The gradients that ``step`` sums across ranks after its backward
(sequence-parallel norms and biases and Qwen3's per-head norms over TP, copies of a key/value
head over the TP ranks holding them, a tied embedding over
the first and last stage, DualPipe's twin stages) must count an earlier step's total once."""
import copy

import torch.distributed as dist

import torchpp
from torchpp.models import parallelize
from hf_reference import assert_grads_match, batch, tiny_model

TIMEOUT_S = 150
STEPS = 3


def check_accumulation(kind, pp, schedule="1f1b", sequence_parallel=False, tied=None, kv_heads=2):
    state = torchpp.init_parallel(tp=2, pp=pp)
    model = tiny_model(kind, tied=tied, kv_heads=kv_heads)
    reference = copy.deepcopy(model)
    wrapped = parallelize(model, schedule=schedule, n_microbatches=4, sequence_parallel=sequence_parallel,
                          state=state)
    what = f"{kind} pp={pp} {schedule} sp={sequence_parallel} tied={tied} kv_heads={kv_heads} rank={dist.get_rank()}"
    for k in range(STEPS):  # no zero_grad in between
        ids, labels = batch(model.config.vocab_size, seed=20 + k)
        reference(input_ids=ids, labels=labels, use_cache=False).loss.backward()
        wrapped.step(ids, labels)
    ref_grads = {name: p.grad for name, p in reference.named_parameters(remove_duplicate=False)}
    assert_grads_match(wrapped.hf_state_dict(grads=True), ref_grads, what)
    return True


def check_tp2():
    check_accumulation("llama", 1, sequence_parallel=True)
    check_accumulation("qwen3", 1)  # per-head q/k norms: summed over TP without SP too
    check_accumulation("llama", 1, kv_heads=1)  # one key/value head, a copy on each TP rank
    return True


def check_pp2_tp2():
    check_accumulation("gpt2", 2, "zb-h1", sequence_parallel=True, tied=True)  # tied across ranks
    check_accumulation("llama", 2, "dualpipe", sequence_parallel=True)  # twins and TP
    check_accumulation("gpt2", 2, "dualpipe", tied=True)
    return True


def test_tp2_steps_accumulate_like_the_unwrapped_model(ranks):
    assert ranks(2).run(check_tp2, timeout=TIMEOUT_S) == [True, True]


def test_pp2_tp2_steps_accumulate_like_the_unwrapped_model(ranks):
    assert ranks(4).run(check_pp2_tp2, timeout=TIMEOUT_S) == [True] * 4
