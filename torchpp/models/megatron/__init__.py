"""Megatron-core models under torchpp's schedules: a drop-in for Megatron's schedule function.

    from torchpp.models.megatron import get_forward_backward_func   # was megatron.core.pipeline_parallel
    forward_backward_func = get_forward_backward_func("zb-h1")

Importing this package imports megatron-core; ``import torchpp`` does not. See docs/megatron.md.
"""
from torchpp.models.megatron.grads import finalize_model_grads, parallel_state, summed_after_backward
from torchpp.models.megatron.schedule import ForwardBackwardFunc, get_forward_backward_func
from torchpp.models.megatron.split_linears import route_split_bw

__all__ = ["ForwardBackwardFunc", "finalize_model_grads", "get_forward_backward_func", "parallel_state",
           "route_split_bw", "summed_after_backward"]
