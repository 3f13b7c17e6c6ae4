"""Fault suite, checkpoint integrity: a flipped byte in any file of a committed checkpoint.

A 2-rank job (a tiny Llama under parallelize at pp=2, passed to torchpp.checkpoint as it is)
saves a checkpoint after one AdamW step: rank 0 and rank 1 each write a data shard, rank 0
DCP's `.metadata` index and `checksums.json`. For every file, a copy of the checkpoint gets one
byte inverted (same size) at its start, middle and end; loading it raises CorruptCheckpointError
on every rank, naming that file (each rank checks its share of the files, so a file rank 1
checks fails rank 0 too), and leaves the model and the optimizer untouched. verify=False loads a
checkpoint with a flipped data byte without a word (so the check is what catches it); a
checkpoint without checksums.json (an older torchpp's) loads with a warning.
"""
import os
import shutil
import warnings

import pytest
import torch

WORLD = 2
TIMEOUT_S = 180
_MODEL = {}  # per rank: the model and optimizer, built once for every case


def _model_and_optimizer():
    if not _MODEL:
        import torchpp
        from torchpp.models import parallelize
        from torchpp.parallel import DistributedOptimizer
        from torchpp.testing.tiny_models import tiny_model

        state = torchpp.init_parallel(pp=2)
        model = parallelize(tiny_model("llama", dtype=torch.float32), schedule="1f1b", n_microbatches=2, state=state)
        optimizer = DistributedOptimizer(model, torch.optim.AdamW, state, accumulations_per_step=2, lr=1e-2)
        _MODEL.update(model=model, optimizer=optimizer, state=state)
    return _MODEL["model"], _MODEL["optimizer"]


def _snapshot(model, optimizer):
    moments = [t.clone() for s in optimizer.torch_optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    return [p.detach().clone() for p in model.parameters()], moments


def _save(root):
    from torchpp.checkpoint import save_checkpoint

    model, optimizer = _model_and_optimizer()
    ids = torch.randint(0, model.config.vocab_size, (4, 8), generator=torch.Generator().manual_seed(0))
    optimizer.zero_grad()
    model.step(ids if model.has_first_stage else None, labels=ids if model.has_last_stage else None)
    optimizer.step()
    save_checkpoint(root, 1, model, optimizer)  # the parallelize'd model itself, at pp=2
    return sorted(os.listdir(os.path.join(root, "step_1")))


def _load(root, verify=True):
    """(error type and message or None, whether parameters and optimizer state are unchanged)."""
    from torchpp.checkpoint import load_checkpoint

    model, optimizer = _model_and_optimizer()
    with torch.no_grad():  # unlike the checkpoint, whatever the case before loaded
        for p in model.parameters():
            p.add_(1.0)
    before = _snapshot(model, optimizer)
    error = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            load_checkpoint(root, model, optimizer, verify=verify)
        except Exception as e:  # noqa: BLE001 (its type and text are what is checked)
            error = (type(e).__name__, str(e))
    after = _snapshot(model, optimizer)
    unchanged = all(torch.equal(a, b) for x, y in zip(before, after) for a, b in zip(x, y))
    return error, unchanged, [str(w.message) for w in caught]


def _flipped_copy(saved, root, name, offset):
    shutil.copytree(saved, root)
    path = os.path.join(root, "step_1", name)
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.seek(offset % size)
        byte = f.read(1)
        f.seek(offset % size)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert os.path.getsize(path) == size


@pytest.fixture(scope="module")
def saved(ranks, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("saved") / "ckpt")
    names = ranks(WORLD).run(_save, root, timeout=TIMEOUT_S)[0]
    assert names == [".metadata", "__0_0.distcp", "__1_0.distcp", "checksums.json"], names
    return root, names


def test_a_flipped_byte_in_any_file_fails_the_load_on_every_rank(ranks, saved, tmp_path):
    root, names = saved
    for name in names:
        size = os.path.getsize(os.path.join(root, "step_1", name))
        for offset in (0, size // 2, size - 1):
            flipped = str(tmp_path / f"{name.strip('.')}_{offset}")
            _flipped_copy(root, flipped, name, offset)
            for rank, (error, unchanged, _) in enumerate(ranks(WORLD).run(_load, flipped, timeout=TIMEOUT_S)):
                what = f"{name} flipped at byte {offset}, rank {rank}"
                assert error is not None and error[0] == "CorruptCheckpointError", f"{what}: {error}"
                assert name in error[1] and "corrupted" in error[1] and "nothing was loaded" in error[1], \
                    f"{what}: {error[1]}"
                assert unchanged, f"{what}: the model or optimizer changed although the load was refused"


def test_verify_false_skips_the_check_and_old_checkpoints_load_with_a_warning(ranks, saved, tmp_path):
    root, _ = saved
    flipped = str(tmp_path / "flipped")
    _flipped_copy(root, flipped, "__1_0.distcp", 12345)
    for error, unchanged, _ in ranks(WORLD).run(_load, flipped, verify=False, timeout=TIMEOUT_S):
        assert error is None and not unchanged  # loaded, flipped byte and all
    old = str(tmp_path / "old")
    shutil.copytree(root, old)
    os.remove(os.path.join(old, "step_1", "checksums.json"))
    for error, unchanged, caught in ranks(WORLD).run(_load, old, timeout=TIMEOUT_S):
        assert error is None and not unchanged, error
        assert any("records no checksums" in w for w in caught), caught
    intact = ranks(WORLD).run(_load, root, timeout=TIMEOUT_S)
    assert all(error is None and not unchanged and not [w for w in caught if "torchpp" in w]
               for error, unchanged, caught in intact), intact
