"""A model built on the meta device, wrapped, then filled by load_hf_weights from the checkpoint
save_pretrained wrote equals the model wrapped with its weights: every parameter and buffer,
and a step's loss and gradients against the unwrapped model. save_hf_checkpoint writes it back
as a checkpoint that from_pretrained reads bit for bit."""
import copy
import json
import os

import pytest
import torch
import torch.distributed as dist

import torchpp
from torchpp.models import load_hf_weights, parallelize, save_hf_checkpoint
from hf_reference import check_wrapped_step, inputs_of, reference_step, tiny_model

TIMEOUT_S = 150

# (family, pp, schedule, tied, checkpoint form[, key/value heads]); tp=2 throughout, 4 ranks
# (dp = 2 when pp = 1).
CASES = (
    ("llama", 1, "1f1b", False, "safetensors"),
    # Conv1D weights stored transposed; the tied head is not in the checkpoint, and its rank
    # holds a copy of the embedding's table.
    ("gpt2", 2, "zb-h1", True, "sharded"),
    # Fused qkv and gate_up, regrouped per TP rank on the way in.
    ("phi3", 2, "1f1b", False, "state_dict"),
    # Scaled embeddings, tied on one rank; per-head norms; both ends of DualPipe.
    ("gemma", 1, "1f1b", True, "bin"),
    ("qwen3", 2, "dualpipe", False, "sharded"),
    # A rotary table per attention type, recomputed from the config for the meta model.
    ("gemma3", 2, "1f1b", True, "safetensors"),
    # Experts stored as 3-D tensors: [gate; up] regrouped along dim 1, down cut along dim 2.
    ("mixtral", 2, "zb-h1", False, "sharded"),
    # One key/value head: each TP rank loads a copy of it, and one copy is saved.
    ("qwen2", 2, "zb-h1", False, "safetensors", 1),
)


def _save(model, form, directory):
    if dist.get_rank() == 0:
        if form == "sharded":  # several files and model.safetensors.index.json
            model.save_pretrained(directory, max_shard_size="30KB")
            assert os.path.isfile(os.path.join(directory, "model.safetensors.index.json"))
        elif form == "bin":
            os.makedirs(directory, exist_ok=True)
            torch.save(model.state_dict(), os.path.join(directory, "pytorch_model.bin"))
        elif form == "safetensors":
            model.save_pretrained(directory)
    dist.barrier()
    return model.state_dict() if form == "state_dict" else directory


def check_load(case, directory):
    kind, pp, schedule, tied, form, kv_heads = (*case, 2)[:6]
    state = torchpp.init_parallel(tp=2, pp=pp)
    model = tiny_model(kind, tied=tied, kv_heads=kv_heads)
    checkpoint = _save(model, form, directory)
    with torch.device("meta"):
        meta = type(model)(model.config)
    wrapped = parallelize(meta, schedule=schedule, n_microbatches=4, state=state)
    ids, labels, _, _ = inputs_of("plain", model.config.vocab_size)
    with pytest.raises(RuntimeError, match="load_hf_weights"):
        wrapped.step(ids, labels)
    load_hf_weights(wrapped, checkpoint)

    what = f"{kind} pp={pp} {schedule} {form} kv_heads={kv_heads}"
    original = copy.deepcopy(model)  # parallelize shards model itself, in place
    expected = parallelize(model, schedule=schedule, n_microbatches=4, state=state)
    got_params, want_params = dict(wrapped.named_parameters()), dict(expected.named_parameters())
    assert got_params.keys() == want_params.keys(), what
    for name, param in got_params.items():
        assert torch.equal(param, want_params[name]), f"{what}: {name}"
    want_buffers = dict(expected.named_buffers())
    for name, buffer in wrapped.named_buffers():
        assert torch.equal(buffer, want_buffers[name]), f"{what}: buffer {name}"
    _check_saved(wrapped, original, os.path.join(directory, "saved"), what)
    _, ref_loss, ref_grads = reference_step(original, ids, labels)
    return check_wrapped_step(wrapped, ids, labels, ref_loss, ref_grads, what)


def _check_saved(wrapped, model, directory, what):
    """save_hf_checkpoint's folder: every tensor of the original, bit for bit, through
    from_pretrained; the tied head left out; one file per pipeline rank holding new stages."""
    assert save_hf_checkpoint(wrapped, directory) == directory
    assert not os.path.exists(directory + ".tmp"), what
    with open(os.path.join(directory, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    want = model.state_dict()
    assert set(weight_map) == _names_transformers_writes(model, directory + ".hf"), what
    files = sorted(set(weight_map.values()))
    dualpipe = "dualpipe" in what  # rank 1 holds rank 0's stages again: nothing new to write
    assert len(files) == (1 if dualpipe else wrapped.state.pp), (what, files)
    reloaded = type(model).from_pretrained(directory)
    for name, value in reloaded.state_dict().items():
        assert torch.equal(value, want[name]), f"{what}: saved {name}"


def _names_transformers_writes(model, directory):
    """The tensor names save_pretrained writes for ``model`` (Mixtral's experts one by one, no
    tied head)."""
    from safetensors import safe_open

    if dist.get_rank() == 0:
        model.save_pretrained(directory)
    dist.barrier()
    with safe_open(os.path.join(directory, "model.safetensors"), framework="pt") as f:
        return set(f.keys())


def check_all(directory):
    return [check_load(case, os.path.join(directory, str(i))) for i, case in enumerate(CASES)]


def test_meta_model_loaded_from_checkpoint_equals_wrapped_model(ranks, tmp_path):
    per_rank = ranks(4).run(check_all, str(tmp_path), timeout=TIMEOUT_S)
    for i in range(len(CASES)):
        assert any(names[i] for names in per_rank), CASES[i]


def check_errors(directory):
    state = torchpp.init_parallel(tp=2, pp=1)
    model = tiny_model("llama")
    _save(model, "safetensors", directory)
    with torch.device("meta"):
        other = type(model)(type(model.config)(**{**model.config.to_dict(), "intermediate_size": 96}))
    wrapped = parallelize(other, state=state)
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.(gate|up|down)_proj.weight of shape"):
        load_hf_weights(wrapped, directory)
    partial = {k: v for k, v in model.state_dict().items() if k != "model.norm.weight"}
    with pytest.raises(KeyError, match="model.norm.weight"):
        load_hf_weights(parallelize(copy.deepcopy(model), state=state), partial)
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        load_hf_weights(wrapped, os.path.join(directory, "missing"))
    with torch.device("meta"):
        meta = type(model)(model.config)
    with pytest.raises(ValueError, match="split='auto'"):
        parallelize(meta, split="auto", state=torchpp.init_parallel(tp=1, pp=2))
    # A save never replaces a folder (not atomically possible); a crashed save's leftovers go.
    saved, wrapped = os.path.join(directory, "saved"), parallelize(copy.deepcopy(model), state=state)
    with pytest.raises(RuntimeError, match="already exists"):
        save_hf_checkpoint(wrapped, directory)
    if dist.get_rank() == 0:
        os.makedirs(saved + ".tmp")
        open(os.path.join(saved + ".tmp", "model-00001-of-00009.safetensors"), "w").close()
    dist.barrier()
    save_hf_checkpoint(wrapped, saved, dtype=torch.bfloat16)
    assert sorted(os.listdir(saved)) == ["config.json", "model-00001-of-00001.safetensors",
                                         "model.safetensors.index.json"]
    reloaded = type(model).from_pretrained(saved)  # in the dtype its config names
    assert reloaded.dtype == torch.bfloat16
    for name, value in reloaded.state_dict().items():
        assert torch.equal(value, model.state_dict()[name].to(torch.bfloat16)), name
    return True


def test_clear_errors(ranks, tmp_path):
    assert ranks(4).run(check_errors, str(tmp_path), timeout=60) == [True] * 4


# DCP training checkpoints of models whose TP shards are not one contiguous block of the full
# tensor: fused qkv/gate_up split block by block (Phi-3), fused qkv + a vocabulary padded to a
# multiple of tp (GPT-2, 61 tokens), one key/value head copied onto both TP ranks (Qwen2), experts
# split along their last dim with their biases, one whole and summed over TP (GPT-OSS).
DCP_KINDS = (("phi3", 2), ("gpt2", 2), ("qwen2", 1), ("gpt_oss", None))


def _dcp_steps(kind, kv_heads, tp, root, save_after=None, load=False, dtype=torch.float64, restore=True, zero=0,
               plan=None):
    """Two AdamW steps of `kind` at this tp (dp = world / tp, ZeRO stage `zero`) on the same
    batches, on the group's device in `dtype`; saves after the first when `save_after`, or loads
    before the second when `load` (skipping the first; `restore=False` skips the load too: a
    control)."""
    from torchpp.checkpoint import load_checkpoint, save_checkpoint
    from torchpp.parallel import DistributedOptimizer

    state = torchpp.init_parallel(tp=tp, pp=1)
    torch.manual_seed(0 if not load else 1)  # the loading run starts from other weights
    from torchpp.testing import tiny_models

    # (kv_heads None: a family hf_reference does not build, from torchpp's tiny models)
    hf = tiny_models.tiny_model(kind) if kv_heads is None else tiny_model(kind, kv_heads=kv_heads)
    model = parallelize(hf.to(dtype), state=state, plan=plan)
    optimizer = DistributedOptimizer(model, torch.optim.AdamW, state, zero=zero, lr=1e-2)
    ids, labels, _, _ = inputs_of("plain", model.config.vocab_size)
    ids, labels = ids.to(state.device), labels.to(state.device)
    losses = []
    for step in range(2):
        if step == 0 and load:
            if restore:
                load_checkpoint(root, model, optimizer, state=state)
            continue
        optimizer.zero_grad()
        loss = model(input_ids=ids, labels=labels, use_cache=False).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if step == 0 and save_after:
            save_checkpoint(root, 1, model, optimizer, state=state)
    return losses[-1]


def test_dcp_checkpoint_of_fused_padded_and_copied_shards_reloads_at_another_tp(ranks, tmp_path):
    for kind, kv_heads in DCP_KINDS:
        root = str(tmp_path / kind)
        saved = ranks(2).run(_dcp_steps, kind, kv_heads, 2, root, save_after=True, timeout=TIMEOUT_S)
        loaded = ranks(2).run(_dcp_steps, kind, kv_heads, 1, root, load=True, timeout=TIMEOUT_S)
        # The second step after loading at tp=1 (dp=2) gives the uninterrupted tp=2 run's loss.
        assert abs(loaded[0] - saved[0]) <= 1e-9 * abs(saved[0]), (kind, saved, loaded)


# Bamba's Mamba 2 mixer under plan="auto": one group of B and C copied on both TP ranks.
ZERO_KINDS = DCP_KINDS + (("bamba", None, "auto"),)


def _dcp_steps_of_every_kind(tp, root, zero, **how):
    return [_dcp_steps(kind, kinds[0], tp, os.path.join(root, kind), zero=zero, plan=(kinds[1:] or [None])[0], **how)
            for kind, *kinds in ZERO_KINDS]


def test_zero_sharded_state_of_fused_padded_and_copied_shards_reloads_at_another_layout(ranks, tmp_path):
    # Under ZeRO a rank holds a flat segment of its TP shard's AdamW moments, scattered over the
    # full tensor these layouts save (and Bamba's copied B and C rows): saved at tp=2 x dp=2 under
    # ZeRO-3 (parameters held as dp shards too), loaded under ZeRO-1 at the same layout (segments
    # cut from the full tensor) and at tp=1 x dp=4 without ZeRO.
    root = str(tmp_path)
    saved = ranks(4).run(_dcp_steps_of_every_kind, 2, root, 3, save_after=True, timeout=TIMEOUT_S)[0]
    for tp, zero in ((2, 1), (1, 0)):
        loaded = ranks(4).run(_dcp_steps_of_every_kind, tp, root, zero, load=True, timeout=TIMEOUT_S)[0]
        for (kind, *_), before, after in zip(ZERO_KINDS, saved, loaded):
            assert abs(after - before) <= 1e-9 * abs(before), (kind, tp, zero, before, after)
    control = ranks(4).run(_dcp_steps_of_every_kind, 2, root, 1, load=True, restore=False, timeout=TIMEOUT_S)[0]
    assert all(abs(c - s) > 1e-6 * abs(s) for c, s in zip(control, saved)), (control, saved)  # the load matters
