"""Wrapped transformers models with each decoder layer compiled (as torchtitan compiles its blocks;
aot_eager: autograd traced ahead, no C++ build), none of them breaking its graph or abandoned by
dynamo, equal the unwrapped model in float64: loss, logits, every gradient and one SGD step
(torchpp.testing.model_checks). Llama at tp=2 with and without sequence parallelism, whose hooks
run with each compiled layer (one once made dynamo abandon its frame: a comprehension there), and
at pp=2 under 1f1b and interleaved-1f1b, whose stages leave the stack after their last layer by an
exception (raised inside that layer's graph, it once made dynamo give up the layer: it ran
uncompiled). Zero-bubble schedules run their split-B/W linears eagerly between compiled graphs
(test_pipeline_compile.py). cp=2 x pp=2 on packed rows: the position ids a later stage's layers get
come with the hidden states, not from the batch's sharding, so the compiled layers are given segment
ids whatever the rows. cp alone: test_context_parallel_models.py."""
import pytest

from torchpp.testing.model_checks import check_cp, check_pp, check_tp

TIMEOUT_S = 300


def check_tp_layers():
    return [check_tp("llama", compiled="layers"), check_tp("llama", sequence_parallel=True, compiled="layers")]


def test_tp2_layers_compiled(ranks):
    results = ranks(2).run(check_tp_layers, timeout=TIMEOUT_S)
    assert all(len(r) == 2 and all("grads" in done for done in r) for r in results), results


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved-1f1b"])
def test_pp2_layers_compiled(ranks, schedule):
    results = ranks(2).run(check_pp, "llama", schedule=schedule, compiled="layers", timeout=TIMEOUT_S)
    assert all("grads on this rank" in r for r in results), results


def test_cp2_pp2_layers_compiled_on_packed_rows(ranks):
    results = ranks(4).run(check_cp, "llama", pp=2, packed=True, schedule="1f1b", compiled="layers", timeout=TIMEOUT_S)
    assert all("grads on this rank" in r for r in results), results
