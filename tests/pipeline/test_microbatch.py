"""torchpp.pipeline.microbatch against torch.distributed.pipelining.microbatch: the same chunk
specs split the same arguments into the same microbatches and merge the same outputs, and
torch's spec objects mean the same to torchpp; what cannot be split gets an error naming it."""
from __future__ import annotations

import pytest
import torch
from torch.distributed.pipelining import microbatch as theirs

from torchpp.pipeline import microbatch as ours

M = 3


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {name: torch.randn(*shape, generator=g) for name, shape in
            {"x": (7, 5, 4), "seq_first": (6, 8, 2), "mask": (7, 5), "bias": (4,)}.items()}


def _cases(mod):
    """(args, kwargs, args_chunk_spec, kwargs_chunk_spec) in the spec classes of ``mod``."""
    t = _tensors()
    spec, rep = mod.TensorChunkSpec, mod._Replicate
    return {
        "defaults": ((t["x"], 2.0, "name"), {"mask": t["mask"], "flag": True}, None, None),
        "nested": ((t["x"], [t["mask"], (t["x"], 1)]), {"extra": {"m": t["mask"]}}, None, None),
        "dims": ((t["seq_first"], t["bias"]), {"mask": t["mask"]}, (spec(1), rep()),
                 spec.from_dict({"mask": 0})),
        "from_tuple": ((t["x"], t["seq_first"]), {}, spec.from_tuple((0, 1)), None),
        "negative_dim": ((t["mask"],), {}, (spec(-2),), None),
        "replicate_class": ((t["x"], t["bias"]), {}, (spec(0), rep), None),
    }


def _assert_same(a, b):
    flat_a, struct_a = torch.utils._pytree.tree_flatten(a)
    flat_b, struct_b = torch.utils._pytree.tree_flatten(b)
    assert struct_a == struct_b
    for u, v in zip(flat_a, flat_b):
        if isinstance(u, torch.Tensor):
            assert torch.equal(u, v) and u.shape == v.shape
        else:
            assert u == v


@pytest.mark.parametrize("case", list(_cases(ours)))
@pytest.mark.parametrize("spec_module", [ours, theirs], ids=["torchpp_specs", "torch_specs"])
def test_split_as_torch_splits(case, spec_module):
    args, kwargs, args_spec, kwargs_spec = _cases(spec_module)[case]
    want = theirs.split_args_kwargs_into_chunks(args, kwargs, M, *_cases(theirs)[case][2:])
    got = ours.split_args_kwargs_into_chunks(args, kwargs, M, args_spec, kwargs_spec)
    assert len(got[0]) == len(got[1]) == M
    _assert_same(got, want)


@pytest.mark.parametrize("spec_module", [ours, theirs], ids=["torchpp_specs", "torch_specs"])
def test_merge_as_torch_merges(spec_module):
    t = _tensors()
    chunks = [(t["x"][i:i + 2], t["seq_first"][:, i:i + 1], torch.tensor(float(i)), "same") for i in range(M)]
    spec = spec_module.TensorChunkSpec
    merge_spec = (spec(0), spec(1), spec_module.sum_reducer, None)
    torch_spec = (theirs.TensorChunkSpec(0), theirs.TensorChunkSpec(1), theirs.sum_reducer, None)
    _assert_same(ours.merge_chunks(chunks, merge_spec), theirs.merge_chunks(chunks, torch_spec))
    plain = [c[:2] for c in chunks]
    _assert_same(ours.merge_chunks(plain, None), theirs.merge_chunks(plain, None))
    with pytest.raises(ValueError,
                       match=r"output_merge_spec TensorChunkSpec\(0\) has 1 leaves but the stage output has 2"):
        ours.merge_chunks(plain, ours.TensorChunkSpec(0))
    merged = ours.merge_chunks(chunks, merge_spec)
    assert merged[2].item() == 0 + 1 + 2 and merged[1].shape == (6, 3, 2)


def test_errors_name_the_offending_value():
    t = _tensors()
    with pytest.raises(ValueError, match=r"shape \(4,\) cannot be split into 5 microbatches along dim 0"):
        ours.split_args_kwargs_into_chunks((t["bias"],), {}, 5)
    with pytest.raises(ValueError, match=r"shape \(7, 5\) cannot be split into 3 microbatches along dim 2"):
        ours.split_args_kwargs_into_chunks((t["mask"],), {}, M, (ours.TensorChunkSpec(2),))
    with pytest.raises(ValueError, match=r"positional arguments chunk spec \(TensorChunkSpec\(0\),\) has 1 leaves "
                                         r"but the positional arguments have 2"):
        ours.split_args_kwargs_into_chunks((t["x"], t["mask"]), {}, M, (ours.TensorChunkSpec(0),))
    with pytest.raises(TypeError, match="leaf 1 has chunk spec TensorChunkSpec\\(0\\) but is a float"):
        ours.split_args_kwargs_into_chunks((t["x"], 2.0), {}, M, ours.TensorChunkSpec.from_tuple((0, 0)))
    with pytest.raises(TypeError, match="keyword arguments leaf 0 has chunk spec 'dim 1'"):
        ours.split_args_kwargs_into_chunks((), {"m": t["mask"]}, M, None, {"m": "dim 1"})
    # A merge spec that neither concatenates nor reduces keeps one value, which must agree.
    with pytest.raises(ValueError, match="output leaf 1 has merge spec 'keep' but differs between microbatches"):
        ours.merge_chunks([(t["x"], 1), (t["x"], 2)], (ours.TensorChunkSpec(0), "keep"))
