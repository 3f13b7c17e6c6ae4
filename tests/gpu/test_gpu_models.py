"""A transformers Llama on the GPU over NCCL, against the unwrapped model run in one process on
the same GPU, in float32 (rtol 1e-5; torchpp.testing.model_checks.assert_close): loss, every
gradient and one SGD step. pp=2 under each schedule family, tp=2 (with and without sequence
parallelism; with it, every decoder layer compiled too), pp=2 x tp=2 on 4 ranks; and pp=2 under torch.autocast (bf16, fp16), where the
split-B/W linears' autocast kernel computes in the low precision."""
import copy

import pytest
import torch

import torchpp
from torchpp.models import parallelize
from torchpp.testing.model_checks import _compare_grads, check_pp, check_tp, precision
from torchpp.testing.tiny_models import tiny_model

TIMEOUT_S = 300
SCHEDULES = ["1f1b", "zb-h1", "interleaved-1f1b", "zb-v", "dualpipe-v"]


def check_pp_schedules(tp: int, schedules):
    return [check_pp("llama", pp=2, tp=tp, schedule=name, n_microbatches=4, dtype=torch.float32)
            for name in schedules]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_llama_pp2(gpu_ranks, schedule):
    assert all(gpu_ranks(2).run(check_pp_schedules, 1, [schedule], timeout=TIMEOUT_S))


def check_tp2():
    # (and every layer compiled, aot_eager: no triton build; SP's hooks traced with the layers over NCCL)
    return [check_tp("llama", tp=2, sequence_parallel=sp, dtype=torch.float32) for sp in (False, True)] + \
        [check_tp("llama", tp=2, sequence_parallel=True, dtype=torch.float32, compiled="layers")]


def test_llama_tp2(gpu_ranks):
    assert all(gpu_ranks(2).run(check_tp2, timeout=TIMEOUT_S))


def test_llama_pp2_tp2(gpu_ranks):
    assert all(gpu_ranks(4).run(check_pp_schedules, 2, ["1f1b", "zb-h1"], timeout=TIMEOUT_S))


M = 4


def check_autocast(dtype_name: str):
    """pp=2 zb-h1 under autocast vs one process under the same autocast, microbatch by
    microbatch (the pipeline's order of work): equal to float32's rtol 1e-5 (the same low-precision
    kernels on the same shapes); while the float32 run without autocast differs from both by
    far more, which shows autocast really ran."""
    low = getattr(torch, dtype_name)
    state = torchpp.init_parallel(pp=2)
    model = tiny_model("llama", dtype=torch.float32)
    reference, plain = copy.deepcopy(model).to(state.device), copy.deepcopy(model).to(state.device)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (M, 16), generator=torch.Generator().manual_seed(7)).to(state.device)
    wrapped = parallelize(model, schedule="zb-h1", n_microbatches=M, state=state)
    with torch.autocast(state.device.type, dtype=low):
        loss = wrapped.step(ids if wrapped.has_first_stage else None, ids if wrapped.has_last_stage else None)
    for rows in ids.split(1):  # equal microbatches, no ignored label: each weighs 1/M
        with torch.autocast(state.device.type, dtype=low):
            (reference(input_ids=rows, labels=rows, use_cache=False).loss / M).backward()
        (plain(input_ids=rows, labels=rows, use_cache=False).loss / M).backward()
    grads = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    with precision(torch.float32):  # float32 gradients, accumulated in another order
        compared = _compare_grads(wrapped, grads, f"autocast {dtype_name} pp=2 zb-h1")
    assert all(p.grad.dtype == torch.float32 for p in wrapped.parameters() if p.grad is not None)
    gap = max(((p.grad - grads[n]).abs().max() / grads[n].abs().max()).item()
              for n, p in plain.named_parameters() if p.grad is not None)
    assert gap > 1e-4, f"autocast {dtype_name}: float32 gradients within {gap:.1e} of the autocast ones"
    return compared if loss is None else loss.dtype


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16"])
def test_llama_pp2_under_autocast(gpu_ranks, device, dtype_name):
    if device.type == "cpu" and dtype_name == "float16":
        pytest.skip("CPU autocast runs bfloat16 only")
    assert all(gpu_ranks(2).run(check_autocast, dtype_name, timeout=TIMEOUT_S))
