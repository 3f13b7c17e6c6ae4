"""torch.compile over tensor-parallel transformers models: Llama at tp=2, with and without sequence
parallelism, each decoder layer compiled (aot_eager: autograd traced
ahead, no C++ build) with no graph break, equals the unwrapped model in float64: loss, logits, every gradient and one
SGD step (torchpp.testing.model_checks.check_tp). Sequence parallelism's hooks run with each
compiled layer: one once broke the graph (comprehensions dynamo could not trace there) and ran
eagerly. The whole model compiled: test_context_parallel_models.py
(cp) and by hand (tp, in docs/tensor_parallel.md)."""
from torchpp.testing.model_checks import check_tp

TIMEOUT_S = 300


def check_compiled_layers():
    return [check_tp("llama", compiled="layers"), check_tp("llama", sequence_parallel=True, compiled="layers")]


def test_tp2_layers_compiled_whole(ranks):
    results = ranks(2).run(check_compiled_layers, timeout=TIMEOUT_S)
    assert all(len(r) == 2 and all("grads" in done for done in r) for r in results), results
