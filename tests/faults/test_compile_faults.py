"""torch.compile over torchpp's ops: what once went wrong, one case each.

- All-to-all context parallelism traced c10d's in-place all-to-all, whose write into its output
  a functional graph drops: the compiled op returned uninitialised memory (NaN), silently.
- The cp ops' fake kernels gave outputs the query's strides while the kernels return them
  contiguous: a compiled model's backward planned views on the wrong strides and failed (GPT-OSS,
  Bloom), on transformers' [b, s, h, d] layout.
- The expert ops have data-dependent sizes: fake tensors failed on them with a RecursionError.
- Compiled layers of a cp model read the count of sharded calls (a guard on its value) and
  whether rows were packed (a data-dependent branch): a recompile at every call, up to dynamo's
  limit (fullgraph: an error), and a graph break in every layer. The count's case is here; the
  whole model's, layers compiled over batches packed and not: test_context_parallel_models.py.
- The pipeline's scatter slice read a concrete numel in its fake kernel (dynamic shapes failed),
  and its gather ran the all-gather on fake tensors.
- Frames dynamo gave up on, run eagerly without a word (counted as "unimplemented", not as graph
  breaks): sequence parallelism's hook recording a layer's other inputs (a comprehension), and a
  pipeline stage's last layer, whose exit hook raised inside the layer's graph."""
import torch
import torch.distributed as dist

from torchpp.context_parallel.hf_support import AttentionCalls

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


def test_counting_calls_in_compiled_code_recompiles_nothing():
    calls = AttentionCalls()

    @torch.compile(backend="eager", fullgraph=True)
    def layer(x):
        calls.made()
        return x * 2

    with torch._dynamo.config.patch(recompile_limit=1):
        for _ in range(3):
            layer(torch.ones(2))
    assert calls.compiled and calls.count == 0


def _p2p_opcheck():
    from test_pipeline_p2p import _opcheck
    return _opcheck((4, 6, 8))


def test_p2p_fake_kernels(ranks):
    assert ranks(2).run(_p2p_opcheck) == [True, True]


def test_sequence_parallel_hooks_trace():
    from torchpp.tensor_parallel.plan import _record_outside_inputs, _stream_args_hook

    outside = set()
    record = torch.compile(_record_outside_inputs(outside), backend="eager")
    gather = torch.compile(_stream_args_hook(lambda t: t * 2, outside), backend="eager")
    torch._dynamo.utils.counters.clear()
    hidden, bias, encoder = torch.ones(2, 3), torch.ones(2, 3), torch.ones(2, 3)
    record(None, (hidden, encoder), {})
    args, kwargs = gather(None, (hidden,), {"residual": bias, "encoder_states": encoder})
    assert not torch._dynamo.utils.counters["unimplemented"], dict(torch._dynamo.utils.counters["unimplemented"])
    assert torch.equal(args[0], hidden * 2) and torch.equal(kwargs["residual"], bias * 2)
    assert kwargs["encoder_states"] is encoder  # given to the layer from outside: never a slice


def _stage_exit_under_compiled_layers():
    from torchpp.testing.model_checks import check_pp
    return check_pp("llama", schedule="1f1b", compiled="layers")


def test_a_stage_leaves_after_its_compiled_last_layer(ranks):
    assert all("grads on this rank" in r for r in ranks(2).run(_stage_exit_under_compiled_layers))
