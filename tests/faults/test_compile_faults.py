"""torch.compile over torchpp's ops: what once went wrong, one case each.

- All-to-all context parallelism traced c10d's in-place all-to-all, whose write into its output
  a functional graph drops: the compiled op returned uninitialised memory (NaN), silently.
- The cp ops' fake kernels gave outputs the query's strides while the kernels return them
  contiguous: a compiled model's backward planned views on the wrong strides and failed (GPT-OSS,
  Bloom), on transformers' [b, s, h, d] layout.
- The expert ops have data-dependent sizes: fake tensors failed on them with a RecursionError."""
import torch
import torch.distributed as dist

from test_context_parallel_attention import _check_case, _inputs
from test_moe_dispatch import check_compiled as check_compiled_experts
from torchpp.context_parallel import shard_sequence


def _compiled_all_to_all():
    _check_case(8, kv_heads=2, mode="all-to-all", layout="zigzag", causal=True, packed=False, compiled=True)
    return True


def test_compiled_all_to_all_equals_full_attention(ranks):
    assert ranks(2).run(_compiled_all_to_all) == [True, True]


def _fake_strides_of_a_strided_query():
    group = dist.group.WORLD
    q, k, v, _ = (shard_sequence(t, group, dim=2).transpose(1, 2).contiguous().transpose(1, 2)
                  for t in _inputs(8, kv_heads=2))
    torch.library.opcheck(torch.ops.torchpp.ring_attention_forward.default,
                          (q, k, v, None, group.group_name, group.size(), True, None, "zigzag"),
                          test_utils=("test_faketensor",))
    return True


def test_fake_kernels_give_the_real_strides(ranks):
    assert ranks(2).run(_fake_strides_of_a_strided_query) == [True, True]


def test_compiled_code_runs_the_expert_ops(ranks):
    assert ranks(2).run(check_compiled_experts) == [True, True]
