"""torchpp's tensor-parallel plans for Mamba mixers (transformers' Mamba, Falcon-Mamba and Mamba 2
carry none), Megatron's channel split:

- Mamba (Mamba 1): ``in_proj``'s two halves [x; z] by columns, the depthwise conv, ``A_log``, ``D``
  and ``dt_proj`` by channel, ``out_proj`` by rows. ``x_proj`` reads this rank's channels: its
  output (dt, B, C) is summed over TP, and since the per-channel scan reads it back on this rank's
  channels only, its gradient is summed too (``rowwise_copy_output``: g then f). ``dt_proj``'s
  weight is read directly, not called.
- Mamba 2: ``in_proj``'s five blocks [z; x; B; C; dt] each by columns, the conv's [x; B; C]
  channels likewise, heads (``A_log``, ``D``, ``dt_bias``) and the gated norm's channels split:
  each rank holds whole groups of heads (``n_groups`` divisible by tp), and the norm is over each
  group, so nothing crosses ranks until ``out_proj``'s row split.

transformers runs mamba-ssm's fused training kernels where they are installed: they read the
weights past the TP forwards, so the wrap is refused there.
"""
from __future__ import annotations

import inspect
import sys
from typing import Callable, Dict, Optional, Tuple

from torch import nn

from torchpp.tensor_parallel.sharding import PlanError, TPContext

MAMBA_PLAN = {
    "backbone.embeddings": "embedding_rowwise",
    "backbone.layers.*.mixer.in_proj": "packed_colwise",
    "backbone.layers.*.mixer.conv1d": "conv_channels",
    "backbone.layers.*.mixer.x_proj": "rowwise_copy_output",
    "backbone.layers.*.mixer.dt_proj.weight": "colwise",
    "backbone.layers.*.mixer.dt_proj.bias": "colwise",
    "backbone.layers.*.mixer.A_log": "colwise",
    "backbone.layers.*.mixer.D": "colwise",
    "backbone.layers.*.mixer.out_proj": "rowwise",
    "lm_head": "colwise_gather_output",
}
# The mixer's fused training kernel, by model type (transformers' name for it in the mixer's module).
FUSED_KERNELS = {"mamba": "mamba_inner_fn", "falcon_mamba": "mamba_inner_fn",
                 "mamba2": "mamba2_split_conv1d_scan_combined"}
# Mamba 2's mixer counts what it splits in attributes: this rank's after the split.
MAMBA2_COUNTS = ("intermediate_size", "conv_dim", "n_groups", "num_heads")


def mamba_plan(model: nn.Module, tp: int) -> Tuple[Dict[str, str], Callable[[nn.Module, TPContext], None]]:
    """(plan, fixups) of a Mamba or Falcon-Mamba model."""
    return dict(MAMBA_PLAN), refuse_fused_kernel


def mamba2_plan(model: nn.Module, tp: int) -> Tuple[Dict[str, str], Callable[[nn.Module, TPContext], None]]:
    """(plan, fixups) of a Mamba 2 model: its fused blocks' sizes read from its first mixer.

    Raises:
        PlanError: tp does not divide the mixer's groups (each rank holds whole groups of heads).
    """
    mixer = _first_mixer(model)
    if mixer.n_groups % tp:
        raise PlanError(f"torchpp.parallelize: tp={tp} does not divide {type(mixer).__name__}'s n_groups="
                        f"{mixer.n_groups} (each rank holds whole groups of heads: Megatron's Mamba 2 split)")
    inner, groups = mixer.intermediate_size, mixer.n_groups * mixer.ssm_state_size
    plan = {name: style for name, style in MAMBA_PLAN.items() if "dt_proj" not in name and "x_proj" not in name}
    plan.update({
        "backbone.layers.*.mixer.in_proj": f"packed_colwise({inner},{inner},{groups},{groups},{mixer.num_heads})",
        "backbone.layers.*.mixer.conv1d": f"conv_channels({inner},{groups},{groups})",
        "backbone.layers.*.mixer.dt_bias": "colwise",
        "backbone.layers.*.mixer.norm.weight": "colwise",
    })
    return plan, _mamba2_fixups


def _mamba2_fixups(model: nn.Module, ctx: TPContext) -> None:
    refuse_fused_kernel(model, ctx)
    for module in model.modules():
        if type(module).__name__ == "Mamba2Mixer":
            for attribute in MAMBA2_COUNTS:
                setattr(module, attribute, getattr(module, attribute) // ctx.size)


def refuse_fused_kernel(model: nn.Module, ctx: Optional[TPContext]) -> None:
    """Raises PlanError where transformers would train the mixer through mamba-ssm's fused kernel."""
    mixer = _first_mixer(model)
    fused = getattr(sys.modules[type(mixer).__module__], FUSED_KERNELS[model.config.model_type], None)
    try:  # the reference implementation returns None whatever it is given, a kernel fails on None inputs
        required = [name for name, p in inspect.signature(fused).parameters.items()
                    if p.default is p.empty and p.kind is p.POSITIONAL_OR_KEYWORD] if fused is not None else []
        in_use = fused is not None and fused(*[None] * len(required)) is not None
    except Exception:  # noqa: BLE001 - a real kernel
        in_use = True
    if in_use:
        raise PlanError(f"torchpp.parallelize: {type(mixer).__name__} trains through mamba-ssm's fused kernel, which "
                        f"reads its weights past the tensor-parallel forwards: uninstall mamba-ssm (transformers then "
                        f"runs the mixer's modules) or use tp=1")


def _first_mixer(model: nn.Module) -> nn.Module:
    return model.get_submodule("backbone.layers.0.mixer")
