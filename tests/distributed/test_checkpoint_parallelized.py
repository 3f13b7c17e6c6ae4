"""torchpp.checkpoint takes a parallelize'd model as it is, at any pp (no stage_parameters), and
AsyncCheckpointer writes while training goes on.

Saved at pp=2 under zb-h1 x tp=2, interleaved 1F1B (two stages per rank) and DualPipe (each
stage on two ranks), with tied or untied embeddings, and loaded into the same model unsharded
(pp=1, tp=1, dp=4): every parameter and AdamW moment equals the saving run's, gathered whole.
A background save taken between two pipeline steps at pp=2 x tp=2 (its thread's collectives
running while the next step's run) holds the state of its step, not the one after, and loads
as a synchronous save of that step does.
"""
import os

import pytest
import torch

WORLD = 4
TIMEOUT_S = 240
LAYOUTS = [("zb-h1", 2, False), ("interleaved-1f1b", 1, True), ("dualpipe", 1, False)]  # schedule, tp, tied


def _build(schedule, tp_size, tied, seed, pp=2):
    import torchpp
    from torchpp.models import parallelize
    from torchpp.parallel import DistributedOptimizer
    from torchpp.testing.tiny_models import tiny_model

    state = torchpp.init_parallel(tp=tp_size, pp=pp)
    hf = tiny_model("llama", seed=seed, num_layers=4, tie_word_embeddings=tied)
    model = parallelize(hf, schedule=schedule, n_microbatches=4, state=state) if pp > 1 else parallelize(hf, state=state)
    optimizer = DistributedOptimizer(model, torch.optim.AdamW, state, accumulations_per_step=4, lr=1e-2,
                                     hold=[model.tied_weight] if model.tied_weight is not None else [])
    return model, optimizer


def _train_step(model, optimizer, seed):
    ids = torch.randint(0, model.config.vocab_size, (8, 8), generator=torch.Generator().manual_seed(seed))
    optimizer.zero_grad()
    model.step(ids if model.has_first_stage else None, labels=ids if model.has_last_stage else None)
    optimizer.step()


def _whole(model, optimizer):
    """{name: full tensor} of this rank's parameters and AdamW moments (collective over TP)."""
    params = model.full_state_dict()
    out = {f"param {n}": t.clone() for n, t in params.items()}
    by_param = dict(model.named_parameters())
    grads_like = {}
    for key in ("exp_avg", "exp_avg_sq"):
        for name, param in by_param.items():  # a moment shares its parameter's layout
            grads_like[name] = optimizer.torch_optimizer.state[param][key]
        original = {n: p.grad for n, p in by_param.items()}
        for name, param in by_param.items():
            param.grad = grads_like[name]
        for name, tensor in model.full_state_dict(grads=True).items():
            out[f"{key} {name}"] = tensor.clone()
        for name, param in by_param.items():
            param.grad = original[name]
    return out


def save_parallelized(root, schedule, tp_size, tied):
    from torchpp.checkpoint import save_checkpoint

    model, optimizer = _build(schedule, tp_size, tied, seed=1)
    _train_step(model, optimizer, 0)
    save_checkpoint(root, 1, model, optimizer)  # the model itself, whatever stages this rank holds
    return _whole(model, optimizer)


def load_unsharded(root, tied):
    from torchpp.checkpoint import load_checkpoint

    model, optimizer = _build(None, 1, tied, seed=2, pp=1)
    _train_step(model, optimizer, 5)  # AdamW state to overwrite
    with pytest.warns(UserWarning, match="RNG states were not restored"):
        load_checkpoint(root, model, optimizer)
    return _whole(model, optimizer)


@pytest.mark.parametrize("schedule,tp_size,tied", LAYOUTS)
def test_a_parallelized_model_saves_at_pp2_as_it_is(ranks, tmp_path, schedule, tp_size, tied):
    root = str(tmp_path / "ckpt")
    saved = {}
    for part in ranks(WORLD).run(save_parallelized, root, schedule, tp_size, tied, timeout=TIMEOUT_S):
        saved.update(part)
    loaded = ranks(WORLD).run(load_unsharded, root, tied, timeout=TIMEOUT_S)[0]
    assert set(saved) == set(loaded), sorted(set(saved) ^ set(loaded))
    for name, tensor in saved.items():
        assert torch.equal(loaded[name], tensor), name


def save_in_background(root):
    from torchpp.checkpoint import AsyncCheckpointer, load_checkpoint, save_checkpoint

    model, optimizer = _build("zb-h1", 2, False, seed=1)
    _train_step(model, optimizer, 0)
    at_step_1 = _whole(model, optimizer)
    saver = AsyncCheckpointer(os.path.join(root, "async"))
    saver.save(1, model, optimizer)
    for k in range(1, 3):  # training goes on while the thread writes
        _train_step(model, optimizer, k)
    path = saver.close()
    later = _whole(model, optimizer)
    load_checkpoint(os.path.join(root, "async"), model, optimizer)
    from_async = _whole(model, optimizer)
    fresh, fresh_optimizer = _build("zb-h1", 2, False, seed=1)
    _train_step(fresh, fresh_optimizer, 0)
    save_checkpoint(os.path.join(root, "sync"), 1, fresh, fresh_optimizer)
    load_checkpoint(os.path.join(root, "sync"), model, optimizer)
    from_sync = _whole(model, optimizer)
    assert path == os.path.join(root, "async", "step_1") and sorted(os.listdir(path))[-1] == "checksums.json"
    changed = any(not torch.equal(later[n], at_step_1[n]) for n in at_step_1)
    return changed, all(torch.equal(from_async[n], at_step_1[n]) and torch.equal(from_sync[n], at_step_1[n])
                        for n in at_step_1)


def test_a_background_save_holds_its_step_while_training_goes_on(ranks, tmp_path):
    results = ranks(WORLD).run(save_in_background, str(tmp_path), timeout=TIMEOUT_S)
    assert all(changed for changed, _ in results)  # the steps after the save did change the state
    assert all(equal for _, equal in results), results
