"""Checkpoints of expert-parallel models: a DCP checkpoint saved at ep=2 (each rank holding half
of the experts and their AdamW state) reloads at ep=1 and at ep=2, and the run goes on as the
uninterrupted one; save_hf_checkpoint writes transformers' own layout (Mixtral's experts one by
one), which from_pretrained reads as the full model."""
import json
import os

import pytest
import torch
import torch.distributed as dist

import torchpp
from torchpp.models import parallelize
from torchpp.testing.expert_checks import full_batch
from torchpp.testing.tiny_models import tiny_model

TIMEOUT_S = 240


def _steps(ep, root, save_after=False, load=False, tp=1, zero=0):
    """Two AdamW steps of Mixtral at this ep (and tp, with experts split over TP too; each dp
    rank its own two rows; ``zero``: ZeRO-1, the experts' state sharded over expert_dp_group);
    saves after the first, or loads before the second (skipping the first). Returns the second
    step's mean loss."""
    from torchpp.checkpoint import load_checkpoint, save_checkpoint
    from torchpp.parallel import DistributedOptimizer

    state = torchpp.init_parallel(tp=tp, ep=ep)
    model = parallelize(tiny_model("mixtral", seed=1234 if not load else 99), state=state, ep=ep,
                        expert_tensor_parallel=tp > 1)
    optimizer = DistributedOptimizer(model.parameters(), torch.optim.AdamW, state, lr=1e-2, zero=zero)
    ids, labels = full_batch(model.config.vocab_size, rows=2 * state.dp)
    mine = slice(2 * state.dp_rank, 2 * state.dp_rank + 2)
    loss = None
    for step in range(2):
        if step == 0 and load:
            load_checkpoint(root, model, optimizer, state=state)
            continue
        optimizer.zero_grad()
        loss = model(input_ids=ids[mine], labels=labels[mine], use_cache=False).loss
        loss.backward()
        optimizer.step()
        if step == 0 and save_after:
            save_checkpoint(root, 1, model, optimizer, state=state)
    mean = loss.detach().clone()
    dist.all_reduce(mean, group=state.dp_group)
    return mean.item() / state.dp


def test_dcp_checkpoint_at_ep2_reloads_at_ep1_and_ep2(ranks, tmp_path):
    root = str(tmp_path / "ep")
    saved = ranks(2).run(_steps, 2, root, save_after=True, timeout=TIMEOUT_S)
    for ep in (1, 2):
        loaded = ranks(2).run(_steps, ep, root, load=True, timeout=TIMEOUT_S)
        assert abs(loaded[0] - saved[0]) <= 1e-9 * abs(saved[0]), (ep, saved, loaded)


def _save_hf(directory):
    from torchpp.models import save_hf_checkpoint

    state = torchpp.init_parallel(ep=2)
    model = tiny_model("mixtral")
    want = {name: value.clone() for name, value in model.state_dict().items()}
    wrapped = parallelize(model, state=state, ep=2)
    assert save_hf_checkpoint(wrapped, directory) == directory
    if dist.get_rank() == 0:
        tiny_model("mixtral").save_pretrained(directory + ".hf")
    dist.barrier()
    names = set(json.load(open(os.path.join(directory, "model.safetensors.index.json")))["weight_map"])
    from safetensors import safe_open

    with safe_open(os.path.join(directory + ".hf", "model.safetensors"), framework="pt") as f:
        assert names == set(f.keys())  # transformers' own names: experts one by one
    reloaded = type(model).from_pretrained(directory)
    for name, value in reloaded.state_dict().items():
        assert torch.equal(value, want[name]), f"saved {name}"
    # And back: a meta-device model wrapped at ep=2 takes its experts out of the folder.
    from torchpp.models import load_hf_weights

    from transformers import MixtralForCausalLM

    with torch.device("meta"):
        empty = MixtralForCausalLM(model.config).to(torch.float64)
    loaded = parallelize(empty, state=state, ep=2)
    load_hf_weights(loaded, directory)
    for name, value in loaded.full_state_dict().items():
        assert torch.equal(value, want[name]), f"loaded {name}"
    return len(names)


def test_save_hf_checkpoint_writes_every_expert_in_transformers_layout(ranks, tmp_path):
    counts = ranks(2).run(_save_hf, str(tmp_path / "hf"), timeout=TIMEOUT_S)
    assert counts[0] == counts[1] > 0


@pytest.mark.parametrize("zero", [0, 1])
def test_dcp_checkpoint_at_ep2_tp2_with_etp_reloads_at_ep1(ranks, tmp_path, zero):
    # 4 ranks, tp=2 x dp=2: experts split over ep=2 and (ETP) over tp, saved whole, reloaded at ep=1
    # (experts split over tp only, by the TP plan). Under ZeRO-1 the AdamW state of the experts'
    # fused [gate; up] (split block by block over tp) is held as flat segments, saved whole too.
    root = str(tmp_path / "etp")
    saved = ranks(4).run(_steps, 2, root, save_after=True, tp=2, zero=zero, timeout=TIMEOUT_S)
    loaded = ranks(4).run(_steps, 1, root, load=True, tp=2, zero=zero, timeout=TIMEOUT_S)
    assert abs(loaded[0] - saved[0]) <= 1e-9 * abs(saved[0]), (saved, loaded)


def test_dcp_checkpoint_of_zero1_expert_state_reloads_at_other_ep_and_zero(ranks, tmp_path):
    # 4 ranks, dp=4: at ep=2 each expert's AdamW state is sharded over its 2 expert-data-parallel
    # ranks (ZeRO-1) and saved as chunks of the whole tensor; reloaded without ZeRO at ep=1 and
    # ep=4 and with it at ep=2, the second step equals the uninterrupted one.
    root = str(tmp_path / "zero1")
    saved = ranks(4).run(_steps, 2, root, save_after=True, zero=1, timeout=TIMEOUT_S)
    for ep, zero in ((1, 0), (4, 0), (2, 1)):
        loaded = ranks(4).run(_steps, ep, root, load=True, zero=zero, timeout=TIMEOUT_S)
        assert abs(loaded[0] - saved[0]) <= 1e-9 * abs(saved[0]), (ep, zero, saved, loaded)


def _pipeline_steps(ep, pp, root, save_after=False, load=False):
    """Two AdamW steps of Mixtral at ep x pp on 4 ranks (zb-h1, dp = 4 / pp, the 4 rows split
    over dp); saves after the first or loads before the second. Returns the second step's
    whole-batch loss (None on ranks without the last stage)."""
    from torchpp.checkpoint import load_checkpoint, save_checkpoint
    from torchpp.parallel import DistributedOptimizer

    state = torchpp.init_parallel(pp=pp, ep=ep)
    model = parallelize(tiny_model("mixtral", seed=1234 if not load else 99), state=state, ep=ep,
                        schedule="zb-h1", n_microbatches=2 if pp > 1 else None)
    optimizer = DistributedOptimizer(model.parameters(), torch.optim.AdamW, state, lr=1e-2,
                                     accumulations_per_step=2 if pp > 1 else 1)
    ids, labels = full_batch(model.config.vocab_size, rows=4)
    rows = 4 // state.dp
    mine = slice(rows * state.dp_rank, rows * (state.dp_rank + 1))
    loss = None
    for step in range(2):
        if step == 0 and load:
            load_checkpoint(root, model, optimizer, state=state)
            continue
        optimizer.zero_grad()
        if pp > 1:
            loss = model.step(ids[mine] if model.has_first_stage else None,
                              labels[mine] if model.has_last_stage else None)
        else:
            loss = model(input_ids=ids[mine], labels=labels[mine], use_cache=False).loss
            loss.backward()
        optimizer.step()
        if step == 0 and save_after:
            save_checkpoint(root, 1, model, optimizer, state=state)
    if loss is None:
        return None
    mean = loss.detach().clone()
    dist.all_reduce(mean, group=state.dp_group)
    return mean.item() / state.dp


def test_dcp_checkpoint_at_ep2_pp2_reloads_without_the_pipeline(ranks, tmp_path):
    # Saved at ep=2 x pp=2 (each stage's experts over its two data-parallel ranks), reloaded
    # at ep=2 x pp=2 and at ep=4 without a pipeline: the second step equals the uninterrupted one
    # (float32 model: rtol 1e-5 across layouts, whose reductions round differently).
    root = str(tmp_path / "ep_pp")
    saved = [r for r in ranks(4).run(_pipeline_steps, 2, 2, root, save_after=True, timeout=TIMEOUT_S) if r is not None]
    for ep, pp in ((2, 2), (4, 1)):
        loaded = [r for r in ranks(4).run(_pipeline_steps, ep, pp, root, load=True, timeout=TIMEOUT_S) if r is not None]
        assert saved and loaded, (saved, loaded)
        assert max(abs(x - saved[0]) for x in saved + loaded) <= 1e-5 * abs(saved[0]), (ep, pp, saved, loaded)
