"""Checkpoints: resuming equals an uninterrupted run, a checkpoint loads under another
(tp, pp, dp) and ZeRO-1 choice, and an interrupted save leaves the previous one loadable."""
import dataclasses
import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

import torchpp.tensor_parallel as tp
from torchpp.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint, stage_parameters
from torchpp.checkpoint import directory
from torchpp.checkpoint.chunks import flat_range_boxes
from torchpp.models.gpt import GPT, GPTConfig, gpt_loss
from torchpp.parallel import DistributedOptimizer, GradScaler, ZeroRedundancyOptimizer, init_parallel
from torchpp.pipeline import split_model
from tp_reference import assert_close, tp_subgroup

# Dropout on: resuming must also restore the default and the TP RNG streams.
CONFIG = GPTConfig(vocab_size=32, hidden_size=16, num_heads=4, num_layers=2, max_seq_len=8, dropout=0.1)
# Layout changes alter the TP streams, so those runs are compared without dropout, in fp64.
EXACT = dataclasses.replace(CONFIG, dropout=0.0)
BATCH, LR, TIMEOUT = 8, 1e-2, 90


def _batch(step):
    g = torch.Generator().manual_seed(100 + step)  # a new batch every step
    shape = (BATCH, CONFIG.max_seq_len)
    return torch.randint(0, CONFIG.vocab_size, shape, generator=g), torch.randint(0, CONFIG.vocab_size, shape, generator=g)


def _build(state, zero, seed, config=CONFIG, dtype=torch.float32, grad_scaler=None):
    """A model and its DistributedOptimizer (AdamW; ZeRO-1 or DP all-reduce), seeded with `seed`."""
    tp.model_parallel_manual_seed(seed, tp_rank=state.tp_rank)
    model = GPT(config, group=state.tp_group).to(dtype)
    return model, DistributedOptimizer(model.parameters(), torch.optim.AdamW, state, zero=zero, lr=LR,
                                       grad_scaler=grad_scaler)


def _train(state, model, optimizer, steps):
    """Runs `steps` (each on its own batch, split over dp); returns the full-batch losses."""
    losses = []
    for step in steps:
        tokens, labels = _batch(step)
        mine = slice(state.dp_rank * BATCH // state.dp, (state.dp_rank + 1) * BATCH // state.dp)
        optimizer.zero_grad()
        loss = gpt_loss(model(tokens[mine]), labels[mine], state.tp_group)
        scaler = optimizer.grad_scaler
        (scaler.scale(loss) if scaler is not None else loss).backward()
        optimizer.step()
        loss = loss.detach().clone()
        dist.all_reduce(loss, group=state.dp_group)
        losses.append(loss / state.dp)
    return torch.stack(losses)


def check_resume(root, layouts):
    """Per (tp, zero): 4 steps straight == 2 steps, save, fresh model and optimizer, load, 2 steps."""
    for tp_size, zero in layouts:
        state = init_parallel(tp=tp_size)
        what = f"tp={tp_size} dp={state.dp} zero={zero}"
        straight = _train(state, *_build(state, zero, seed=11), range(4))
        model, optimizer = _build(state, zero, seed=11)
        first = _train(state, model, optimizer, range(2))
        path = os.path.join(root, what.replace(" ", "_"))
        save_checkpoint(path, 2, model, optimizer, extra={"next": 2})
        # Another seed: only the load can make the fresh model, optimizer and RNG equal.
        model, optimizer = _build(state, zero, seed=99)
        for group in optimizer.param_groups:
            group["lr"] = 0.5  # as an LR schedule would have left it: the saved options win
        loaded = load_checkpoint(path, model, optimizer)
        assert (loaded.step, loaded.extra, loaded.rng_restored) == (2, {"next": 2}, True), what
        second = _train(state, model, optimizer, range(2, 4))
        resumed = torch.cat([first, second])
        assert torch.equal(resumed, straight), f"{what}: resumed {resumed.tolist()} != straight {straight.tolist()}"
    return True


def check_resume_loss_scale(root):
    """With an fp16 loss scaler the resumed run continues the saved scale (and its growth count)."""
    state = init_parallel(tp=1)
    scaler = dict(init_scale=2.0**8, growth_interval=3)
    straight_scaler = GradScaler("cpu", **scaler)
    straight = _train(state, *_build(state, False, seed=11, grad_scaler=straight_scaler), range(4))
    model, optimizer = _build(state, False, seed=11, grad_scaler=GradScaler("cpu", **scaler))
    first = _train(state, model, optimizer, range(2))
    save_checkpoint(root, 2, model, optimizer)
    resumed_scaler = GradScaler("cpu", init_scale=1.0, growth_interval=3)
    model, optimizer = _build(state, False, seed=99, grad_scaler=resumed_scaler)
    load_checkpoint(root, model, optimizer)
    assert resumed_scaler.get_scale() == 2.0**8 and resumed_scaler._get_growth_tracker() == 2
    resumed = torch.cat([first, _train(state, model, optimizer, range(2, 4))])
    assert torch.equal(resumed, straight), f"resumed {resumed.tolist()} != straight {straight.tolist()}"
    # Two good steps after the load complete the growth interval: the scale doubles, as straight on.
    assert resumed_scaler.get_scale() == straight_scaler.get_scale() == 2.0**9
    return True


def test_resume_restores_the_loss_scale(ranks, tmp_path):
    assert ranks(2).run(check_resume_loss_scale, str(tmp_path), timeout=TIMEOUT) == [True] * 2


def test_resume_equals_uninterrupted_run(ranks, tmp_path):
    layouts = [(1, False), (1, True), (2, False)]  # dp=2; dp=2 with ZeRO-1; tp=2
    assert ranks(2).run(check_resume, str(tmp_path), layouts, timeout=TIMEOUT) == [True] * 2


def _reference():
    """One process, fp64, full batches: losses of 4 steps and the state after step 2."""
    alone = tp_subgroup(1)  # a group of this rank only
    torch.manual_seed(11)
    model = GPT(EXACT, group=alone).double()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, snapshot = [], None
    for step in range(4):
        if step == 2:
            snapshot = {
                name: {"param": p.detach().clone(), **{k: v.clone() for k, v in optimizer.state[p].items()}}
                for name, p in model.named_parameters()
            }
        tokens, labels = _batch(step)
        optimizer.zero_grad()
        loss = gpt_loss(model(tokens), labels, alone)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return torch.stack(losses), snapshot


def _save_after_two_steps(root, tp_size, zero):
    state = init_parallel(tp=tp_size)
    model, optimizer = _build(state, zero, seed=11, config=EXACT, dtype=torch.float64)
    losses = _train(state, model, optimizer, range(2))
    save_checkpoint(root, 2, model, optimizer)
    return losses


def _resume_two_steps(root, tp_size, zero):
    state = init_parallel(tp=tp_size)
    model, optimizer = _build(state, zero, seed=99, config=EXACT, dtype=torch.float64)
    with pytest.warns(UserWarning, match="RNG states were not restored"):
        assert not load_checkpoint(root, model, optimizer).rng_restored
    return _train(state, model, optimizer, range(2, 4))


def _held_state(optimizer, params):
    """(parameter, flat range it updates, its state) for everything `optimizer` updates."""
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        return [(s.param, s.param_lo, s.param_lo + s.shard_view.numel(), optimizer.optimizer.state[s.shard_view]) for s in optimizer.segments]
    return [(p, 0, p.numel(), optimizer.state[p]) for p in params]


def _check_pipeline_stage(root, reference, tp_size, zero):
    """Loads into pp=2 (a GPT cut by split_model): every parameter and Adam state equals the
    one-process run's after step 2 (its TP shard, and under ZeRO its flat segment)."""
    state = init_parallel(tp=tp_size, pp=2)
    what = f"pp=2 tp={tp_size} zero={zero}"
    tp.model_parallel_manual_seed(99, tp_rank=state.tp_rank, pp_rank=state.pp_rank)
    full = GPT(EXACT, group=state.tp_group).double()
    parts = split_model(full, 2)
    stage = parts[state.pp_rank]
    params = stage_parameters(stage, full_model=full)
    first_layer = 0 if state.is_first_stage else len(parts[0])
    assert list(stage_parameters(stage, first_layer=first_layer)) == list(params)
    if zero:
        optimizer = ZeroRedundancyOptimizer(stage.parameters(), torch.optim.AdamW, state.dp_group, lr=LR)
    else:
        optimizer = torch.optim.AdamW(stage.parameters(), lr=LR)
    load_checkpoint(root, params, optimizer)

    def local(name, param, key):  # this rank's TP shard of the reference tensor
        want = reference[name][key]
        return want.chunk(tp_size, param.partition_dim)[state.tp_rank] if getattr(param, "tensor_model_parallel", False) else want

    name_of = {id(p): n for n, p in params.items()}
    for name, param in params.items():
        assert_close(param.detach(), local(name, param, "param"), f"{what} {name}")
    held = _held_state(optimizer, params.values())
    assert {name_of[id(p)] for p, *_ in held} == set(params), what
    for param, lo, hi, got in held:
        name = name_of[id(param)]
        assert_close(got["step"], reference[name]["step"], f"{what} {name} step")
        for key in ("exp_avg", "exp_avg_sq"):
            assert_close(got[key].reshape(-1), local(name, param, key).reshape(-1)[lo:hi], f"{what} {name} {key}")
    return sorted(params), sorted(name for name, _ in full.named_parameters())


def check_layout_change(root):
    ref_losses, ref_snapshot = _reference()
    runs = []
    # (saved tp, saved zero) -> (loaded tp, loaded zero), with dp = 2 / tp on both sides.
    for (save_tp, save_zero), (load_tp, load_zero) in (((2, True), (1, True)), ((1, True), (2, False)), ((2, False), (1, False))):
        path = os.path.join(root, f"tp{save_tp}_zero{save_zero}")
        first = _save_after_two_steps(path, save_tp, save_zero)
        second = _resume_two_steps(path, load_tp, load_zero)
        what = f"saved tp={save_tp} zero={save_zero}, loaded tp={load_tp} zero={load_zero}"
        assert_close(torch.cat([first, second]), ref_losses, what)
        runs.append(path)
    return _check_pipeline_stage(runs[1], ref_snapshot, tp_size=1, zero=False)  # saved at dp=2 with ZeRO-1


def test_layout_changing_reload(ranks, tmp_path):
    (first, full), (second, _) = ranks(2).run(check_layout_change, str(tmp_path), timeout=TIMEOUT)
    # The two stages hold disjoint parts that together are the whole model, under global names.
    assert set(first).isdisjoint(second) and sorted(first + second) == full


def _snapshot(model, optimizer):
    inner = optimizer.optimizer.optimizer  # DistributedOptimizer -> ZeroRedundancyOptimizer -> AdamW
    return [p.detach().clone() for p in model.parameters()], [
        {k: v.clone() for k, v in s.items()} for s in inner.state.values()
    ]


def _assert_equal_state(model, optimizer, snapshot, what):
    params, states = _snapshot(model, optimizer)
    assert all(torch.equal(a, b) for a, b in zip(params, snapshot[0])), f"{what}: parameters differ"
    assert len(states) == len(snapshot[1]) and all(
        a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a) for a, b in zip(states, snapshot[1])
    ), f"{what}: optimizer state differs"


def _raise(error):
    def fail(*args, **kwargs):
        raise error

    return fail


def check_dualpipe_twins(root):
    """DualPipe holds every stage on two ranks (rank r: stages r and p-1-r): both save their
    twin copies under the same names, and the checkpoint resumes at pp=1 x dp=2 exactly as
    the one-process run continues (fp64), Adam state included."""
    from torchpp.pipeline import PipelineStage, build_schedule

    ref_losses, _ = _reference()
    state = init_parallel(tp=1, pp=2)
    torch.manual_seed(11)
    full = GPT(EXACT, group=state.tp_group).double()
    parts = split_model(full, 2)
    mine = sorted({state.pp_rank, 1 - state.pp_rank})
    stages = [PipelineStage(parts[k], k, 2, torch.device("cpu"), group=state.pp_group) for k in mine]
    pipeline = build_schedule("dualpipe", stages, 4, loss_fn=lambda out, target: gpt_loss(out, target, state.tp_group))
    params = {name: p for k in mine for name, p in stage_parameters(parts[k], full_model=full).items()}
    assert sorted(params) == sorted(name for name, _ in full.named_parameters())  # the whole model on each rank
    optimizer = DistributedOptimizer(list(params.values()), torch.optim.AdamW, state, lr=LR)
    for step in range(2):
        tokens, labels = _batch(step)
        optimizer.zero_grad()
        pipeline.step(tokens, target=labels)
        optimizer.step()
    save_checkpoint(root, 2, params, optimizer)
    assert_close(_resume_two_steps(root, 1, False), ref_losses[2:], "dualpipe checkpoint resumed at dp=2")
    return True


def test_dualpipe_twin_copies_save_and_resume(ranks, tmp_path):
    assert ranks(2).run(check_dualpipe_twins, str(tmp_path), timeout=TIMEOUT) == [True] * 2


def check_interrupted_save(root):
    state = init_parallel(tp=1)  # dp=2 with ZeRO-1: every rank writes its own shard
    model, optimizer = _build(state, True, seed=11)
    _train(state, model, optimizer, range(1))
    save_checkpoint(root, 1, model, optimizer)
    saved = _snapshot(model, optimizer)
    _train(state, model, optimizer, range(1, 2))

    # 1. Rank 1 fails while writing; rank 0 has written its files.
    write_data = FileSystemWriter.write_data
    if dist.get_rank() == 1:
        FileSystemWriter.write_data = _raise(OSError("disk full (injected)"))
    try:
        with pytest.raises(CheckpointException, match="disk full"):
            save_checkpoint(root, 2, model, optimizer)
    finally:
        FileSystemWriter.write_data = write_data
    assert any(f.startswith("__0_") for f in os.listdir(os.path.join(root, "step_2.tmp")))
    assert not os.path.exists(os.path.join(root, "step_2"))
    assert latest_checkpoint(root) == os.path.join(root, "step_1")
    dist.barrier()  # the next save's rank 0 clears step_2.tmp: every rank has looked at it first

    # 2. Everything written, then the run dies before the commit.
    commit = directory.commit
    directory.commit = _raise(RuntimeError("killed before the rename"))
    try:
        with pytest.raises(RuntimeError, match="killed before the rename"):
            save_checkpoint(root, 2, model, optimizer)
    finally:
        directory.commit = commit
    assert os.path.exists(os.path.join(root, "step_2.tmp", ".metadata"))
    assert latest_checkpoint(root) == os.path.join(root, "step_1")

    fresh_model, fresh_optimizer = _build(state, True, seed=99)
    assert load_checkpoint(root, fresh_model, fresh_optimizer).step == 1
    _assert_equal_state(fresh_model, fresh_optimizer, saved, "previous checkpoint after failed saves")

    # 3. The next save of step 2 clears the leftovers and commits.
    current = _snapshot(model, optimizer)
    save_checkpoint(root, 2, model, optimizer)
    assert latest_checkpoint(root) == os.path.join(root, "step_2") and not os.path.exists(os.path.join(root, "step_2.tmp"))
    assert load_checkpoint(root, fresh_model, fresh_optimizer).step == 2
    _assert_equal_state(fresh_model, fresh_optimizer, current, "step 2")

    # Errors a user can cause.
    with pytest.raises(RuntimeError, match="step_2 already exists"):
        save_checkpoint(root, 2, model, optimizer)
    with pytest.raises(FileNotFoundError, match="no committed checkpoint"):
        load_checkpoint(os.path.join(root, "empty"), model)
    with pytest.raises(KeyError, match="has no parameters"):
        load_checkpoint(root, {"extra.weight": model[0].positions.weight})
    return True


def test_interrupted_save_keeps_previous_checkpoint(ranks, tmp_path):
    assert ranks(2).run(check_interrupted_save, str(tmp_path), timeout=TIMEOUT) == [True] * 2


def check_layout_change_tp_and_zero(root):
    """TP and ZeRO-1 together: saved at tp=2 x dp=2 with ZeRO-1, every rank a different
    segment of a different TP shard."""
    ref_losses, ref_snapshot = _reference()
    first = _save_after_two_steps(root, 2, True)
    for load_tp, load_zero in ((1, True), (4, False)):
        second = _resume_two_steps(root, load_tp, load_zero)
        assert_close(torch.cat([first, second]), ref_losses, f"saved tp=2 dp=2 zero, loaded tp={load_tp} zero={load_zero}")
    _check_pipeline_stage(root, ref_snapshot, tp_size=2, zero=True)
    return True


def test_layout_changing_reload_tp_and_zero(ranks, tmp_path):
    assert ranks(4).run(check_layout_change_tp_and_zero, str(tmp_path), timeout=TIMEOUT) == [True] * 4


@pytest.mark.parametrize("shape", [(), (7,), (3, 4), (2, 3, 4)])
def test_flat_range_boxes_tile_every_range(shape):
    numel = torch.Size(shape).numel()
    for lo in range(numel):
        for hi in range(lo + 1, numel + 1):
            filled = torch.zeros(shape, dtype=torch.long)
            boxes = flat_range_boxes(shape, lo, hi)
            assert len(boxes) <= max(1, 2 * len(shape) - 1)
            for box in boxes:
                region = filled[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))]
                assert region.numel() == box.numel and not region.any(), (shape, lo, hi, box)  # no overlaps
                region += torch.arange(box.flat_start, box.flat_start + box.numel).view(box.sizes) + 1
            want = torch.zeros(numel, dtype=torch.long)
            want[lo:hi] = torch.arange(lo, hi) + 1
            assert torch.equal(filled.reshape(-1), want), (shape, lo, hi, boxes)
