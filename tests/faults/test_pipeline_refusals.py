"""Pipeline cuts that would train on wrong gradients are refused while wrapping, on every rank,
with a PlanError naming what and why (2 gloo ranks, tiny float32 models, seconds):

- a model whose own loss reads more than its logits (ProphetNet adds its n-gram streams'
  predictions): the last stage computes the loss from the logits alone;
- a tensor the model's forward builds from a layer's output and hands to later layers itself
  (Inkling 2's block states, a block boundary at every layer): the stage starting at layer 2
  would build it from placeholders where it holds layer 0's output, and its gradient would not
  reach layer 0 (only the output of the layer before a stage reaches it: the hidden states);
- layers run inside a custom autograd function that computes their gradients itself (Reformer's
  reversible layers, recomputed in its backward): no stage can hold their autograd graph (they
  once failed on every rank at the first forward, with an AttributeError).
"""
import pytest
import torch

from fault_utils import assert_outcomes, run_case

WITHIN_S = 60.0  # one traced forward of a tiny model, then the refusal

CASES = {
    "loss reads more than the logits": ("prophetnet", {}, ["ProphetNetForCausalLM's own loss reads more than its logits"]),
    "tensor carried between layers": ("inkling2_text", {"n_layers_per_attn_res_block": 1},
                                      ["model.layers.2 reads a tensor", "output of model.layers.0",
                                       "stage starting at model.layers.2", "use pp=1"]),
    "layers run inside a custom autograd function": ("reformer", {}, [
        "4 layers of reformer.encoder.layers", "run without autograd inside ReformerModelWithLMHead's forward",
        "use pp=1"]),
}


def wrap(model_type, extra):
    import torchpp
    from torchpp.models import parallelize
    from torchpp.testing.tiny_models import tiny_model

    def attempt():
        state = torchpp.init_parallel(tp=1, pp=2)
        parallelize(tiny_model(model_type, dtype=torch.float32, **extra), state=state, plan="auto",
                    schedule="zb-h1", n_microbatches=2)
    try:
        return run_case(attempt)
    finally:
        torchpp.destroy_parallel()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", sorted(CASES))
def test_refused_on_every_rank(ranks, case):
    model_type, extra, fragments = CASES[case]
    outcomes = ranks(2).run(wrap, model_type, extra, timeout=90)
    assert_outcomes(outcomes, "PlanError", fragments, within_s=WITHIN_S)
