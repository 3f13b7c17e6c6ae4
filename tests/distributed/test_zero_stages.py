"""ZeRO-2 and ZeRO-3 (DistributedOptimizer(zero=2|3)) on wrapped transformers models, fp64: dp=2
at pp=1 (with a GradScaler's loss scaling too, the non-finite guard, and bf16 autocast
against ZeRO-1, and ZeRO-3 with post-validation), at pp=2 under 1f1b and zb-h1 (tied GPT-2 embeddings on different stages; W passes
deliver the weight gradients that the reduce-scatter waits for), DualPipe and interleaved
1F1B (ZeRO-3) and zb-v (ZeRO-2), and dp=2 x tp=2 (also with
sequence parallelism and full recompute). Three AdamW
steps with global-norm clipping give the losses and norms of the unwrapped model trained in
one process on the full batch (rtol 1e-9), and each rank holds 1/dp of the sharded state:
measured from the storages allocated after each step."""
import contextlib
import copy

import pytest

import torch
import torch.distributed as dist

import torchpp
from torchpp.models import parallelize
from torchpp.models.parallelize import causal_lm_loss
from torchpp.parallel import DistributedOptimizer, GradScaler
from hf_reference import tiny_model

STEPS, LR, MAX_NORM, ROWS, SEQ = 3, 1e-2, 0.5, 8, 8
BUCKET_BYTES = 8192


def _ids(vocab):
    g = torch.Generator().manual_seed(5)
    return torch.randint(0, vocab, (ROWS, SEQ), generator=g)


def _reference(model):
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    ids = _ids(model.config.vocab_size)
    losses, norms = [], []
    for _ in range(STEPS):
        optimizer.zero_grad()
        # torchpp's loss stays in fp64 (transformers' own casts the logits to float32)
        loss = causal_lm_loss(model(input_ids=ids).logits, ids, None, model.config.vocab_size)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
        optimizer.step()
        losses.append(loss.detach())
    return torch.stack(losses), torch.stack(norms)


def _check_bytes(what, memory, local_numel, buckets, dp, zero):
    """Sharded parts hold local_numel / dp elements, plus under one element of padding per
    bucket; the full parameters (zero=2) local_numel plus under dp elements per bucket."""
    full, shard = local_numel * 8, local_numel * 8 / dp
    want = {"param": (shard, buckets * 8) if zero == 3 else (full, buckets * dp * 8),
            "grad": (shard, buckets * 8), "optimizer": (2 * shard, 2 * buckets * 8)}  # AdamW: two moments
    for kind, (low, slack) in want.items():
        assert low <= memory[kind] < low + slack, (
            f"{what}: {kind} bytes {memory[kind]}, want {low} (+ padding < {slack}); the model's local parameters "
            f"are {full} bytes, dp={dp}")


def check_zero(kind, schedule, zero, tp=1, pp=1, microbatches=1, kv_heads=2, reshard_after_forward=False,
               scaled=False, every_microbatch=False, **wrap):
    state = torchpp.init_parallel(tp=tp, pp=pp, dp=2)
    model = tiny_model(kind, kv_heads=kv_heads).double()
    what = (f"{kind} dp=2 tp={tp} pp={pp} {schedule} zero={zero} reshard_after_forward={reshard_after_forward} "
            f"scaled={scaled} every_microbatch={every_microbatch} {wrap}")
    # A loss scale of 2^16 is exact in fp64: scaled and unscaled, the gradients are the same.
    scaler = GradScaler("cpu") if scaled else None
    reference, reference_norms = _reference(copy.deepcopy(model))
    wrapped = parallelize(model, schedule=schedule, n_microbatches=microbatches, state=state,
                          vocab_parallel_logits=pp == 1, grad_scaler=scaler, **wrap)  # at pp=1 so that the loss is torchpp's (fp64) too
    hold = [wrapped.tied_weight] if wrapped.tied_weight is not None else []
    optimizer = DistributedOptimizer(wrapped, torch.optim.AdamW, state, zero=zero, max_norm=MAX_NORM,
                                     accumulations_per_step=microbatches // (2 if schedule == "dualpipe" else 1), hold=hold, bucket_bytes=BUCKET_BYTES, lr=LR,
                                     reshard_after_forward=reshard_after_forward, grad_scaler=scaler,
                                     reduce_every_microbatch=every_microbatch)
    local_numel = sum(p.numel() for p in optimizer.params)
    buckets = len(optimizer.optimizer.flat_groups)
    ids = _ids(model.config.vocab_size)
    rows = ids.chunk(state.dp)[state.dp_rank]
    losses, norms = [], []
    for _ in range(STEPS):
        optimizer.zero_grad()
        gathers, rounds = optimizer.optimizer.gathers, optimizer.reducer.rounds
        optimizer.optimizer.gathered_buckets.peak = 0
        loss = wrapped.step(rows if wrapped.has_first_stage else None, labels=rows if wrapped.has_last_stage else None)
        if microbatches == 1:  # no accumulation: after backward, the shards and one bucket still in flight
            flats = optimizer.optimizer.flat_groups
            in_flight = max(f.flat_grad.numel() for f in flats) * 8
            shards = sum(f.grad_shard.numel() for f in flats) * 8
            assert optimizer.memory_bytes()["grad"] <= shards + in_flight, (
                f"{what}: {optimizer.memory_bytes()['grad']} gradient bytes after backward; shards {shards}, "
                f"largest bucket {in_flight}")
        norms.append(optimizer.step())
        if every_microbatch:  # buckets were reduced and freed before their last microbatch
            assert optimizer.reducer.rounds > rounds, f"{what}: no bucket was reduce-scattered before its last microbatch"
        assert all(p.grad is None for p in optimizer.params), f"{what}: a full gradient outlived its reduce-scatter"
        peak = optimizer.optimizer.gathered_buckets.peak
        if zero == 3 and reshard_after_forward:  # gathered again for later microbatches and for backward
            assert optimizer.optimizer.gathers - gathers > buckets * microbatches, (what, optimizer.optimizer.gathers)
            assert peak < buckets / 2, f"{what}: {peak} of {buckets} buckets gathered at once"
        elif zero == 3:  # one gather per bucket per step, however many microbatches used it
            assert optimizer.optimizer.prefetches > 0, f"{what}: no gather was launched ahead of its module"
            assert peak == buckets, f"{what}: kept gathered, yet only {peak} of {buckets} buckets at once"
            assert optimizer.optimizer.gathers - gathers == buckets, (
                f"{what}: {optimizer.optimizer.gathers - gathers} gathers in a step of {microbatches} microbatches "
                f"over {buckets} buckets")
        _check_bytes(what, optimizer.memory_bytes(), local_numel, buckets, state.dp, zero)
        if wrapped.has_last_stage:
            dist.all_reduce(loss, group=state.dp_group)
            losses.append(loss / state.dp)
    if wrapped.has_last_stage:
        torch.testing.assert_close(torch.stack(losses), reference.double(), rtol=1e-9, atol=0,
                                   msg=lambda m: f"{what}: {m}")
    # The global norm sums squares in float32 (torchpp/parallel/clip.py), whatever the dtype.
    torch.testing.assert_close(torch.stack(norms), reference_norms, rtol=1e-6, atol=0, check_dtype=False,
                               msg=lambda m: f"{what} norms: {m}")
    assert reference_norms.max() > MAX_NORM, reference_norms  # clipping is in force
    return True


def check_nonfinite(zero):
    """A NaN in one rank's gradient (of one bucket's parameter) makes the global norm over the
    shards NaN: the step is skipped on every rank, parameters unchanged; the next step updates."""
    state = torchpp.init_parallel(tp=1, pp=1, dp=2)
    wrapped = parallelize(tiny_model("llama").double(), state=state, vocab_parallel_logits=True, zero=zero)
    if zero == 3:  # the stage is read from the parameters too, and ZeRO-3 needs the modules
        with pytest.raises(ValueError, match="zero=3 gathers parameters before each module's forward"):
            DistributedOptimizer(wrapped.parameters(), torch.optim.AdamW, state, lr=LR)
    optimizer = DistributedOptimizer(wrapped, torch.optim.AdamW, state, max_norm=MAX_NORM, bucket_bytes=BUCKET_BYTES,
                                     lr=LR)
    assert optimizer.zero == zero  # taken from parallelize(zero=)
    rows = _ids(wrapped.config.vocab_size).chunk(2)[state.dp_rank]
    poisoned = wrapped.model.layers[1].mlp.up_proj.weight
    handle = poisoned.register_hook(lambda g: g * float("nan")) if state.dp_rank == 1 else None
    optimizer.zero_grad()
    wrapped.step(rows, labels=rows)
    before = [s.clone() for s in optimizer.optimizer.optimizer.param_groups[0]["params"]]
    with pytest.warns(RuntimeWarning) if state.dp_rank == 0 else contextlib.nullcontext():
        norm = optimizer.step()
    assert optimizer.last_step_skipped and not torch.isfinite(norm), (zero, norm)
    after = optimizer.optimizer.optimizer.param_groups[0]["params"]
    assert all(torch.equal(a, b) for a, b in zip(before, after)), f"zero={zero}: a skipped step changed a shard"
    if handle is not None:
        handle.remove()
    optimizer.zero_grad()
    wrapped.step(rows, labels=rows)
    assert torch.isfinite(optimizer.step()) and not optimizer.last_step_skipped
    return True


def check_bf16_autocast():
    """Under bf16 autocast (fp32 parameters) ZeRO-2 and ZeRO-3 give ZeRO-1's losses: the stages
    change where gradients and weights live, not what is computed."""
    state = torchpp.init_parallel(tp=1, pp=1, dp=2)
    base = tiny_model("llama")
    rows = _ids(base.config.vocab_size).chunk(2)[state.dp_rank]
    losses = {}
    for zero in (1, 2, 3):
        model = parallelize(copy.deepcopy(base), state=state, zero=zero)
        optimizer = DistributedOptimizer(model, torch.optim.AdamW, state, lr=LR, max_norm=MAX_NORM,
                                         bucket_bytes=BUCKET_BYTES)
        losses[zero] = []
        for _ in range(STEPS):
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                losses[zero].append(model.step(rows, labels=rows))
            optimizer.step()
    for zero in (2, 3):
        torch.testing.assert_close(torch.stack(losses[zero]), torch.stack(losses[1]), rtol=1e-6, atol=0,
                                   msg=lambda m: f"bf16 autocast zero={zero} vs zero=1: {m}")
    return True


def check_post_validate_zero3():
    """ZeRO-3 with optimizer post-validation: the accepted losses and the final parameters equal
    the synchronous ZeRO-3 run's, clipped steps rolled back and their batches run again."""
    state = torchpp.init_parallel(tp=1, pp=1, dp=2)
    base = tiny_model("llama").double()
    runs = {}
    for post_validate in (False, True):
        model = parallelize(copy.deepcopy(base), state=state, zero=3, vocab_parallel_logits=True)
        optimizer = DistributedOptimizer(model, torch.optim.AdamW, state, lr=LR, max_norm=MAX_NORM,
                                         post_validate=post_validate, bucket_bytes=BUCKET_BYTES)
        losses, reruns = [], 0
        for step in range(STEPS):
            g = torch.Generator().manual_seed(step)
            rows = torch.randint(0, base.config.vocab_size, (ROWS, SEQ), generator=g).chunk(2)[state.dp_rank]
            while True:
                optimizer.zero_grad()
                loss = model.step(rows, labels=rows)
                optimizer.step()
                if not optimizer.rerun:
                    break
                reruns += 1
            losses.append(loss)
        if post_validate:
            optimizer.flush()
        optimizer.gather_params()
        runs[post_validate] = (torch.stack(losses), [p.detach().clone() for p in model.parameters()], reruns)
    assert runs[True][2] > 0, "no step needed clipping: the roll-back was not exercised"
    torch.testing.assert_close(runs[True][0], runs[False][0], rtol=1e-12, atol=0)
    for a, b in zip(runs[True][1], runs[False][1]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=0)
    return True


def check_pp1():
    return (all(check_zero("llama", "1f1b", zero) and check_nonfinite(zero)
                and check_zero("llama", "1f1b", zero, scaled=True) for zero in (2, 3))
            and check_zero("llama", "1f1b", 3, reshard_after_forward=True)
            and check_bf16_autocast() and check_post_validate_zero3())


def check_pp2():
    return (all(check_zero("gpt2", schedule, zero, pp=2, microbatches=4) for schedule in ("1f1b", "zb-h1")
                for zero in (2, 3))
            # only the shard kept across microbatches too (a reduce-scatter per bucket per microbatch)
            and all(check_zero("gpt2", "zb-h1", zero, pp=2, microbatches=4, every_microbatch=True) for zero in (2, 3))
            and check_zero("gpt2", "zb-h1", 3, pp=2, microbatches=4, reshard_after_forward=True)
            # each rank holds two stages, each stage is on two ranks, the tied pair on both ends
            and check_zero("gpt2", "dualpipe", 3, pp=2, microbatches=4)
            # two stages per rank; under zb-v rank 0 holds both ends, so the tied embedding is
            # accumulated twice per microbatch (held to the end: DistributedOptimizer finds it)
            and check_zero("gpt2", "interleaved-1f1b", 3, pp=2, microbatches=4)
            and check_zero("gpt2", "zb-v", 2, pp=2, microbatches=4))


def check_tp2():
    return (all(check_zero("llama", "1f1b", zero, tp=2, kv_heads=1) for zero in (2, 3))
            # sequence-parallel norms (held to the end), and forwards re-run inside backward
            and check_zero("llama", "1f1b", 3, tp=2, sequence_parallel=True, recompute="full"))


def test_zero_2_and_3_data_parallel(ranks):
    assert ranks(2).run(check_pp1, timeout=300) == [True] * 2


def test_zero_2_and_3_with_pipeline(ranks):
    assert ranks(4).run(check_pp2, timeout=400) == [True] * 4


def test_zero_2_and_3_with_tensor_parallel(ranks):
    assert ranks(4).run(check_tp2, timeout=300) == [True] * 4
