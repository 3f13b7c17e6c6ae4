"""Context parallelism (cp > 1): every attention call of a transformers causal LM runs on this
rank's shard of the sequence, exchanging keys and values over the cp group
(torchpp.context_parallel.hf); the wrapped model shards each batch it is given."""
from __future__ import annotations

from torch import nn

from torchpp.models.parallel_config import ContextOptions
from torchpp.models.passes.state import WrapState


def apply_cp(model: nn.Module, state: WrapState, options: ContextOptions) -> nn.Module:
    """Routes the model's attention through sharded attention (cp > 1; sets ``state.context``).

    Args:
        model: a transformers causal LM (``apply_plans`` refuses anything else at cp > 1).
        state: reads parallel; fills context.
        options: mode (``torchpp.context_parallel.MODES``; "all-to-all+ring" makes its groups here,
            collectively), layout ("zigzag" or "contiguous").
    """
    ps = state.parallel
    if ps.cp == 1:
        return model
    from torchpp.context_parallel.hf import ContextParallel, apply_context_parallel
    from torchpp.context_parallel.own_attention import own_attention_modules, weights_no_longer_returned

    if state.cp_positions is None:
        raise RuntimeError("torchpp.parallelize: cp > 1 reached the context-parallel pass unchecked")
    # (apply_plans checked the whole model, before the pipeline cut, and decided its positions.)
    hierarchical = None
    if options.mode == "all-to-all+ring":
        from torchpp.context_parallel.hierarchical import hierarchical_groups

        hierarchical = hierarchical_groups(options.all_to_all_size, ps.cp_group)
    state.context = ContextParallel(ps.cp_group, options.mode, options.layout, model_positions=state.cp_positions,
                                    hierarchical=hierarchical)
    apply_context_parallel(model, state.context, recompute_core=False,
                           layers=state.layout.layers if state.layout is not None else None)
    if state.layout is not None and own_attention_modules(model):  # every stage holds such layers, or none does
        weights_no_longer_returned(state.layout.extras)
    return model
