"""A parameter that a layer and a module after the stack hold (a final norm tied to the first
layer's norm) lives on both pipeline ranks: its gradients are summed over the pipeline. 2 gloo
ranks, float32 (transformers computes its loss in float32 whatever the model's dtype: hf_reference's
tolerances), against the unwrapped model (loss, eval loss, every local gradient)."""
import copy

import torch

import torchpp
from torchpp.models import parallelize
from hf_reference import batch, check_wrapped_step, reference_step, tiny_model


def _tied_norms():
    model = tiny_model("llama")
    model.model.norm.weight = model.model.layers[0].input_layernorm.weight  # stage 0's layer, the last stage's norm
    with torch.no_grad():
        model.model.norm.weight.uniform_(0.5, 1.5)  # not ones: a missing term changes the gradient
    return model


def check_tied_layer_and_end(schedule, n_microbatches):
    try:
        state = torchpp.init_parallel(tp=1, pp=2)
        model = _tied_norms()
        ids, labels = batch(model.config.vocab_size)
        _, ref_loss, ref_grads = reference_step(copy.deepcopy(model), ids, labels)
        wrapped = parallelize(model, schedule=schedule, n_microbatches=n_microbatches, state=state)
        names = check_wrapped_step(wrapped, ids, labels, ref_loss, ref_grads, f"tied norms {schedule}")
        return "model.norm.weight" in names or "model.layers.0.input_layernorm.weight" in names
    finally:
        torchpp.destroy_parallel()


def test_parameter_of_a_layer_and_an_end_module_summed(ranks):
    # zb-h1: stage 0 (layers 0-1) and stage 1 (layers 2-3, the norm) on ranks 0 and 1;
    # interleaved-1f1b: four stages, layer 0 on rank 0 and the norm on rank 1.
    for schedule, n_microbatches in (("zb-h1", 4), ("interleaved-1f1b", 4)):
        assert ranks(2).run(check_tied_layer_and_end, schedule, n_microbatches, timeout=120) == [True, True]
