"""ZeRO marking: the stage ``DistributedOptimizer(model, ...)`` applies over dp, recorded on the
model and on every parameter (the optimizer reads it from whatever it is given)."""
from __future__ import annotations

from torch import nn

from torchpp.models.passes.state import WrapState
from torchpp.parallel.zero_params import zero_stage


def apply_zero(model: nn.Module, state: WrapState, zero: int) -> nn.Module:
    """Marks ``model.zero_stage`` and each parameter's ``zero_stage``.

    Args:
        model: the model.
        state: unused (every pass takes it).
        zero: the ZeRO stage, 0..3 (True is 1).
    """
    zero = zero_stage(zero)
    model.zero_stage = zero
    for param in model.parameters():
        param.zero_stage = zero
    return model
