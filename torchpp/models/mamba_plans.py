"""torchpp's tensor-parallel plans for Mamba mixers (transformers' Mamba, Falcon-Mamba and Mamba 2
carry none), Megatron's channel split:

- Mamba (Mamba 1): ``in_proj``'s two halves [x; z] by columns, the depthwise conv, ``A_log``, ``D``
  and ``dt_proj`` by channel, ``out_proj`` by rows. ``x_proj`` reads this rank's channels: its
  output (dt, B, C) is summed over TP, and since the per-channel scan reads it back on this rank's
  channels only, its gradient is summed too (``rowwise_copy_output``: g then f). ``dt_proj``'s
  weight is read directly, not called.
- Mamba 2: ``in_proj``'s five blocks [z; x; B; C; dt] each by columns, the conv's [x; B; C]
  channels likewise, heads (``A_log``, ``D``, ``dt_bias``) and the gated norm's channels split:
  where tp divides ``n_groups`` each rank holds whole groups of heads, and the norm is over each
  group, so nothing crosses ranks until ``out_proj``'s row split. Where the ranks outnumber the
  groups, each rank holds its heads' group of B and C, copied (``b@g`` block sizes; their
  gradient rows summed over the copies), and the norm sums its group's squares over the ranks
  sharing it (``gated_group_rmsnorm``).
- Falcon-H1's Mamba 2 mixers: as Mamba 2's; ``mup_vector``, the per-channel scale of in_proj's
  output, is cut like in_proj's rows, and its norm (which may gate after normalising) likewise.
- Zamba's Mamba 1 mixers: channels in heads, each with its own x_proj and dt_proj ([heads, ...]
  tensors, ``split_leading_dim``): whole heads per rank, nothing crosses ranks until out_proj.
- Jamba's Mamba 1 mixers: as Mamba's; its norms on dt, B and C read x_proj's summed output and
  feed this rank's channels, so their gradients are summed over TP.

transformers runs mamba-ssm's fused training kernels where they are installed: they read the
weights past the TP forwards, so the wrap is refused there.
"""
from __future__ import annotations

import inspect
import sys
from typing import Callable, Dict, Optional, Set, Tuple

import torch
from torch import nn

from torchpp.tensor_parallel.group_norm import norm_groups
from torchpp.tensor_parallel.layouts import Packed
from torchpp.tensor_parallel.plan import glob_pattern
from torchpp.tensor_parallel.sharding import PlanError, TPContext

def mamba_mixer_plan(path: str, mixer: Optional[nn.Module] = None) -> Dict[str, str]:
    """The plan entries of the Mamba 1 mixer at ``path`` (a name or a glob). A ``mixer`` given
    may hold norms on x_proj's (summed, whole) output, Jamba's on dt, B and C: each rank's
    channels read them, so their gradients are summed over TP."""
    plan = {f"{path}.in_proj": "packed_colwise", f"{path}.conv1d": "conv_channels",
            f"{path}.x_proj": "rowwise_copy_output", f"{path}.out_proj": "rowwise"}
    plan.update({f"{path}.{name}": "colwise" for name in ("dt_proj.weight", "dt_proj.bias", "A_log", "D")})
    for name, child in (mixer.named_children() if mixer is not None else ()):
        if name not in MAMBA_MODULES and any(True for _ in child.parameters()):
            plan[f"{path}.{name}"] = "replicated_with_grad_allreduce"
    return plan


MAMBA_MODULES = ("in_proj", "conv1d", "x_proj", "dt_proj", "out_proj")
MAMBA_PLAN = {
    "backbone.embeddings": "embedding_rowwise",
    **mamba_mixer_plan("backbone.layers.*.mixer"),
    "lm_head": "colwise_gather_output",
}
# The mixers' fused training kernels (transformers' names for them in the mixer's module).
FUSED_KERNELS = ("mamba_inner_fn", "mamba2_split_conv1d_scan_combined")


def mamba_plan(model: nn.Module, tp: int) -> Tuple[Dict[str, str], Callable[[nn.Module, TPContext], None]]:
    """(plan, fixups) of a Mamba or Falcon-Mamba model."""
    return dict(MAMBA_PLAN), refuse_fused_kernel


def mamba2_plan(model: nn.Module, tp: int) -> Tuple[Dict[str, str], Callable[[nn.Module, TPContext], None]]:
    """(plan, fixups) of a Mamba 2 model: its fused blocks' sizes read from its first mixer.

    Raises:
        PlanError: tp does not divide the mixer's groups (each rank holds whole groups of heads).
    """
    mixer = _first_mixer(model)
    why = why_mamba2_stays_whole(mixer, tp)
    if why:
        raise PlanError(f"torchpp.parallelize: {type(mixer).__name__} cannot split: {why}")
    plan = {name: style for name, style in MAMBA_PLAN.items() if name.count(".mixer.") == 0}
    plan.update(mamba2_mixer_plan("backbone.layers.*.mixer", mixer))
    return plan, lambda module, ctx: (refuse_fused_kernel(module, ctx), divide_mixer_counts(module, plan, ctx))


def is_mamba2_mixer(module: nn.Module) -> bool:
    """A Mamba 2 mixer as transformers writes it (Mamba 2's, and the hybrid families' own classes:
    Bamba, Nemotron-H, Granite hybrid, Zamba 2): in_proj's output [z; x; B; C; dt], a depthwise conv
    over [x; B; C], per-head A_log, D and dt_bias, a norm over each group, out_proj."""
    counts = [getattr(module, name, None) for name in ("intermediate_size", "n_groups", "ssm_state_size",
                                                         "num_heads", "conv_dim")]
    if not all(isinstance(c, int) for c in counts):
        return False
    inner, groups, state, heads, conv = counts
    in_proj, conv1d = getattr(module, "in_proj", None), getattr(module, "conv1d", None)
    return (isinstance(in_proj, nn.Linear) and isinstance(conv1d, nn.Conv1d)
            and isinstance(getattr(module, "out_proj", None), nn.Linear)
            and all(isinstance(getattr(module, name, None), nn.Parameter) for name in ("A_log", "D", "dt_bias"))
            and conv == inner + 2 * groups * state == conv1d.out_channels == conv1d.groups
            and in_proj.out_features == inner + conv + heads)


def is_mamba_mixer(module: nn.Module) -> bool:
    """A Mamba 1 mixer as transformers writes it (Mamba's, Falcon-Mamba's, Jamba's): in_proj's
    output [x; z], a depthwise conv over x, x_proj to (dt, B, C), dt_proj back to the channels,
    per-channel A_log and D, out_proj."""
    in_proj, conv1d, x_proj, dt_proj, out_proj = (getattr(module, name, None) for name in MAMBA_MODULES)
    a_log, d = getattr(module, "A_log", None), getattr(module, "D", None)
    if not (all(isinstance(m, nn.Linear) for m in (in_proj, x_proj, dt_proj, out_proj)) and isinstance(conv1d, nn.Conv1d)
            and isinstance(a_log, nn.Parameter) and isinstance(d, nn.Parameter)):
        return False
    inner = conv1d.out_channels
    return (conv1d.groups == inner and in_proj.out_features == 2 * inner and x_proj.in_features == inner
            and dt_proj.out_features == inner and out_proj.in_features == inner
            and a_log.dim() == 2 and a_log.shape[0] == inner and tuple(d.shape) == (inner,))


ZAMBA_PER_HEAD = ("x_proj_weight", "dt_proj_weight", "dt_proj_bias", "A_log", "D")


def is_zamba_mixer(module: nn.Module) -> bool:
    """Zamba's Mamba 1 mixer: its channels in ``n_mamba_heads`` independent heads, each with its own
    x_proj and dt_proj (tensors [heads, ...]); in_proj's output pairs each channel with its gate."""
    heads, conv1d = getattr(module, "n_mamba_heads", None), getattr(module, "conv1d", None)
    if not isinstance(heads, int) or not isinstance(conv1d, nn.Conv1d) or not all(
            isinstance(getattr(module, name, None), nn.Linear) for name in ("in_proj", "out_proj")):
        return False
    inner = conv1d.out_channels
    per_head = [getattr(module, name, None) for name in ZAMBA_PER_HEAD]
    return (conv1d.groups == inner and module.in_proj.out_features == 2 * inner and module.out_proj.in_features == inner
            and all(isinstance(p, nn.Parameter) and p.shape[0] == heads for p in per_head))


def zamba_mixer_plan(path: str, mixer: Optional[nn.Module] = None) -> Dict[str, str]:
    """The plan entries of Zamba's mixer at ``path``: whole heads per rank, nothing crosses ranks
    until out_proj's row split (in_proj's [x, gate] pairs split with their channels)."""
    plan = {f"{path}.in_proj": "colwise", f"{path}.conv1d": "conv_channels", f"{path}.out_proj": "rowwise"}
    plan.update({f"{path}.{name}": "split_leading_dim" for name in ZAMBA_PER_HEAD})
    return plan


def why_zamba_stays_whole(mixer: nn.Module, tp: int) -> str:
    """Why Zamba's mixer cannot split its heads over tp ranks ("" where it can)."""
    return f"tp={tp} does not divide its n_mamba_heads={mixer.n_mamba_heads}" if mixer.n_mamba_heads % tp else ""


def why_mamba_stays_whole(mixer: nn.Module, tp: int) -> str:
    """Why a Mamba 1 mixer cannot split its channels over tp ranks ("" where it can)."""
    inner = mixer.conv1d.out_channels
    return f"tp={tp} does not divide its {inner} channels" if inner % tp else ""


def why_mamba2_stays_whole(mixer: nn.Module, tp: int) -> str:
    """Why a Mamba 2 mixer cannot split over tp ranks ("" where it can)."""
    groups, heads = mixer.n_groups, mixer.num_heads
    if heads % tp or heads % groups:
        return f"tp={tp} does not divide its num_heads={heads} into whole groups of heads per rank"
    if groups % tp and tp % groups:
        return f"tp={tp} neither divides its n_groups={groups} nor is a multiple of it"
    norm = getattr(mixer, "norm", None)
    if groups < tp and isinstance(getattr(norm, "weight", None), nn.Parameter) and \
            norm_groups(norm, mixer.intermediate_size) is None:
        return f"its norm is not a gated norm over groups of channels, which tp={tp} > n_groups={groups} would split"
    return ""


def mamba2_mixer_plan(path: str, mixer: nn.Module) -> Dict[str, str]:
    """The plan entries of the Mamba 2 mixer at ``path`` (a name or a glob). B and C hold one
    block per group of heads (``@groups``): where the ranks outnumber the groups, each rank holds
    its heads' group, copied over the ranks sharing it, as vLLM does (Megatron asks tp to divide
    n_groups); the gated norm's statistics then sum over those ranks."""
    inner, groups = mixer.intermediate_size, mixer.n_groups * mixer.ssm_state_size
    bc = f"{groups}@{mixer.n_groups}"
    plan = {f"{path}.in_proj": f"packed_colwise({inner},{inner},{bc},{bc},{mixer.num_heads})",
            f"{path}.conv1d": f"conv_channels({inner},{bc},{bc})",
            f"{path}.out_proj": "rowwise"}
    plan.update({f"{path}.{name}": "colwise" for name in ("A_log", "D", "dt_bias")})
    norm = getattr(getattr(mixer, "norm", None), "weight", None)
    if isinstance(norm, nn.Parameter) and norm.shape == (inner,):  # (a norm of another kind: whole groups only)
        grouped = norm_groups(mixer.norm, inner) is not None
        plan[f"{path}.norm" if grouped else f"{path}.norm.weight"] = "gated_group_rmsnorm" if grouped else "colwise"
    return plan


def divide_mixer_counts(model: nn.Module, plan: Dict[str, str], ctx: TPContext) -> Set[str]:
    """Gives the Mamba 2 mixers whose in_proj the plan splits this rank's counts, which they keep
    in attributes (heads, channels, and groups: one copied group where the ranks outnumber them);
    returns their names."""
    done: Set[str] = set()
    split = [glob_pattern(name.rpartition(".")[0]) for name, style in plan.items()
             if name.endswith(".in_proj") and style.startswith("packed_colwise(")]
    zamba = [glob_pattern(name.rpartition(".")[0]) for name, style in plan.items()
             if name.endswith(".x_proj_weight") and style == "split_leading_dim"]
    for name, module in model.named_modules():
        if any(pattern.fullmatch(name) for pattern in zamba):  # Zamba's mixer reshapes by its head count
            module.n_mamba_heads //= ctx.size
            module.intermediate_size //= ctx.size
            done.add(name)
        if any(pattern.fullmatch(name) for pattern in split):  # (sharded already: its shapes are this rank's)
            module.intermediate_size //= ctx.size
            module.num_heads //= ctx.size
            module.n_groups = max(module.n_groups // ctx.size, 1)
            module.conv_dim = module.intermediate_size + 2 * module.n_groups * module.ssm_state_size
            scale = getattr(module, "mup_vector", None)  # Falcon-H1: in_proj's output scaled per channel
            if isinstance(scale, torch.Tensor):
                layout = module.in_proj.weight.tp_layout
                module.mup_vector = Packed(-1, layout.blocks, layout.groups).shard(scale, ctx.rank, ctx.size)
            done.add(name)
    return done


def refuse_fused_kernel(model: nn.Module, ctx: Optional[TPContext], mixer: Optional[nn.Module] = None) -> None:
    """Raises PlanError where transformers would train ``mixer`` (default: the Mamba family's first)
    through mamba-ssm's fused kernel."""
    mixer = _first_mixer(model) if mixer is None else mixer
    for name in FUSED_KERNELS:
        fused = getattr(sys.modules[type(mixer).__module__], name, None)
        if fused is not None and _is_kernel(fused):
            raise PlanError(f"torchpp.parallelize: {type(mixer).__name__} trains through mamba-ssm's fused kernel, "
                            f"which reads its weights past the tensor-parallel forwards: uninstall mamba-ssm "
                            f"(transformers then runs the mixer's modules) or use tp=1")


def _is_kernel(fused) -> bool:
    try:  # the reference implementation returns None whatever it is given, a kernel fails on None inputs
        required = [name for name, p in inspect.signature(fused).parameters.items()
                    if p.default is p.empty and p.kind is p.POSITIONAL_OR_KEYWORD]
        return fused(*[None] * len(required)) is not None
    except Exception:  # noqa: BLE001 - a real kernel
        return True


def mamba_mixers(model: nn.Module, stack: str, tp: int) -> Tuple[Dict[str, str], Dict[str, str]]:
    """(plan entries, {mixer: why it stays whole}) of the Mamba 1 and Mamba 2 mixers in ``stack``'s
    layers (plan="auto": the TP rule cannot split them, their in_proj being cut by hard-coded sizes
    or their x_proj reading every rank's channels)."""
    plan, whole = {}, {}
    for name, module in model.get_submodule(stack).named_modules(prefix=stack):
        kind = ((why_mamba2_stays_whole, mamba2_mixer_plan) if is_mamba2_mixer(module) else
                (why_mamba_stays_whole, mamba_mixer_plan) if is_mamba_mixer(module) else
                (why_zamba_stays_whole, zamba_mixer_plan) if is_zamba_mixer(module) else None)
        if kind is None:
            continue
        why = kind[0](module, tp)
        if why:
            whole[f"{name}.out_proj"] = why
        else:
            refuse_fused_kernel(model, None, module)
            plan.update(kind[1](name, module))
    return plan, whole


def _first_mixer(model: nn.Module) -> nn.Module:
    return model.get_submodule("backbone.layers.0.mixer")
