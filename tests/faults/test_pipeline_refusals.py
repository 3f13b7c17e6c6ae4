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
  once failed on every rank at the first forward, with an AttributeError);
- a tensor a layer computes and a later layer reads without it passing through their arguments
  (kept on a module between the calls): the later stage never computes it. A cut that keeps
  both layers on one stage is not refused. So for state outside autograd (an integer tensor a
  layer stores on the model, read by a later layer or after the stack).
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


def stashing_llama():
    """A tiny Llama whose layer 0 keeps a tensor on the model, which layer 2 adds to its output."""
    from torchpp.testing.tiny_models import tiny_model

    model = tiny_model("llama", dtype=torch.float32)
    layers = model.model.layers

    def patch(index):
        forward = layers[index].forward

        def patched(*args, **kwargs):
            out = forward(*args, **kwargs)
            hidden = out[0] if isinstance(out, tuple) else out
            if index == 0:
                model.model.kept = hidden.mean(-1, keepdim=True)
                return out
            hidden = hidden + model.model.kept
            return (hidden, *out[1:]) if isinstance(out, tuple) else hidden
        layers[index].forward = patched
    patch(0)
    patch(2)
    return model


def wrap_stashing(split):
    import torchpp
    from torchpp.models import parallelize

    def attempt():
        state = torchpp.init_parallel(tp=1, pp=2)
        parallelize(stashing_llama(), state=state, schedule="1f1b", n_microbatches=2, split=split)
    try:
        return run_case(attempt)
    finally:
        torchpp.destroy_parallel()


def counting_llama(read_after_stack: bool):
    """A tiny Llama whose layer 0 stores an integer tensor on the model (outside autograd), which
    layer 2, or the final norm after the stack, reads back to scale its output."""
    from torchpp.testing.tiny_models import tiny_model

    model = tiny_model("llama", dtype=torch.float32)
    layer0, reader = model.model.layers[0], (model.model.norm if read_after_stack else model.model.layers[2])
    forward0, forward_reader = layer0.forward, reader.forward

    def writing(*args, **kwargs):
        model.model.calls = torch.tensor(2)  # an integer: no autograd node joins it to layer 0
        return forward0(*args, **kwargs)

    def reading(*args, **kwargs):
        out = forward_reader(*args, **kwargs)
        scale = model.model.calls.to(torch.float32)
        return (out[0] * scale, *out[1:]) if isinstance(out, tuple) else out * scale
    layer0.forward, reader.forward = writing, reading
    return model


def wrap_counting(read_after_stack, split):
    import torchpp
    from torchpp.models import parallelize

    def attempt():
        state = torchpp.init_parallel(tp=1, pp=2)
        parallelize(counting_llama(read_after_stack), state=state, schedule="1f1b", n_microbatches=2, split=split)
    try:
        return run_case(attempt)
    finally:
        torchpp.destroy_parallel()


@pytest.mark.timeout(200)
def test_module_state_outside_autograd_read_by_a_later_stage(ranks):
    """Integer (or detached) state a layer stores on a module, outside the autograd graph that the
    carried-tensor check walks: the module attributes written and read during the trace tell."""
    outcomes = ranks(2).run(wrap_counting, False, None, timeout=90)
    assert_outcomes(outcomes, "PlanError", ["model.layers.2 reads a tensor computed inside model.layers.0",
                                            "stage starting at model.layers.2"], within_s=WITHIN_S)
    outcomes = ranks(2).run(wrap_counting, False, [3], timeout=90)  # layers 0 to 2 on the first stage
    assert_outcomes(outcomes, None, within_s=WITHIN_S)
    outcomes = ranks(2).run(wrap_counting, True, None, timeout=90)  # the final norm, on the last stage
    assert_outcomes(outcomes, "PlanError", ["the model's forward after the stack reads a tensor computed inside "
                                            "model.layers.0"], within_s=WITHIN_S)


@pytest.mark.timeout(150)
def test_a_tensor_kept_on_a_module_between_layers(ranks):
    outcomes = ranks(2).run(wrap_stashing, None, timeout=90)
    assert_outcomes(outcomes, "PlanError", ["model.layers.2 reads a tensor computed inside model.layers.0",
                                            "stage starting at model.layers.2", "use pp=1"], within_s=WITHIN_S)
    outcomes = ranks(2).run(wrap_stashing, [3], timeout=90)  # layers 0 to 2 on the first stage
    assert_outcomes(outcomes, None, within_s=WITHIN_S)
