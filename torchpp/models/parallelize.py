"""parallelize: tensor, sequence, expert, context and pipeline parallelism for an existing model,
in place, by plan.

    state = torchpp.init_parallel(tp=2, pp=1)
    model = parallelize(LlamaForCausalLM(config), state=state)    # the same object, sharded
    out = model(input_ids=ids, labels=ids)                         # transformers' forward and output
    out.loss.backward(); optimizer.step()                          # gradients complete over TP

    state = torchpp.init_parallel(tp=2, pp=2)
    model = parallelize(LlamaForCausalLM(config), schedule="zb-h1", n_microbatches=8, state=state)
    loss = model.step(ids, labels=ids)                             # forward + backward over the pipeline

The model keeps its own forward, modules and parameter names. ``parallelize`` is a composition
of passes (``torchpp.models.passes``), each ``apply_X(model, state, options) -> model`` reading
its own options (``torchpp.models.parallel_config``) and what the earlier passes recorded in
the ``WrapState``: plans first (every refusal happens there, before the model changes), then
the pipeline cut, experts, TP/SP, CP, recomputation, materialisation, the parallel class, ZeRO
marking and the schedule.
"""
from __future__ import annotations

from typing import Optional

from torch import nn

from torchpp.models.parallel_causal_lm import IGNORE_INDEX, ParallelCausalLM, causal_lm_loss, shift_labels
from torchpp.models.parallel_config import ParallelConfig
from torchpp.models.parallel_model import ParallelModule
from torchpp.models.passes import (WrapState, apply_cp, apply_ep, apply_materialize, apply_parallel_class,
                                   apply_pipeline_cut, apply_plans, apply_recompute, apply_schedule, apply_tp,
                                   apply_zero, resolve_parallel_state)
from torchpp.models.passes.pipeline_cut import layer_bounds
from torchpp.parallel.groups import ParallelState

__all__ = ["IGNORE_INDEX", "ParallelCausalLM", "ParallelConfig", "ParallelModule", "causal_lm_loss", "layer_bounds",
           "parallelize", "shift_labels"]


def parallelize(model: nn.Module, config: Optional[ParallelConfig] = None, *, state: Optional[ParallelState] = None,
                **keywords) -> nn.Module:
    """Shards ``model`` in place over tensor- and pipeline-parallel ranks, by plan.

    The model keeps its class (a subclass of it), its forward, its modules and its parameter
    names. The tensor-parallel plan (transformers' ``base_model_tp_plan`` and head, or ``plan``)
    shards its linears and embeddings in place, each with torch.ops.torchpp's mappings: at
    pp=1 a transformers causal LM is called as before, ``model(input_ids=ids, labels=ids)``,
    returning transformers' output with the full logits (``vocab_parallel_logits=True`` keeps
    each rank's vocabulary slice and computes the loss without gathering it), and gradients
    after ``.backward()`` are complete over TP. With pp > 1 the stack of layers
    (``base_model_pp_plan``, or ``plan["pp"]``) is cut into stages, this rank keeping its own,
    and ``model.step(ids, labels=ids)`` runs the schedule; zero-bubble schedules defer each
    sharded linear's weight gradient to the W pass.

    Args:
        model: a transformers model (with plans, or ``plan="auto"``), or any nn.Module with
            ``plan``; identical on every rank, or built on the meta device (``load_hf_weights``
            then fills the shards).
        config: sizes and options (``ParallelConfig``; default: the parallel state's sizes,
            transformers' plans, schedule "1f1b").
        state: the ParallelState (default: the current one, or ``init_parallel`` of the config's sizes).
        keywords: any of ``ParallelConfig``'s settings by the name ``parallelize`` has always
            taken (``torchpp.models.parallel_config.KEYWORDS``: tp, pp, cp, ep, schedule,
            n_microbatches, plan, sequence_parallel, recompute, split, grad_scaler,
            vocab_parallel_logits, loss_fn, split_bw, cp_mode, cp_layout, capacity_factor,
            expert_tensor_parallel, zero, overlap_forward_backward), set on top of ``config``.

    Returns:
        ``model`` itself, parallelized.
    """
    config = ParallelConfig.from_keywords(config, **keywords)
    state = WrapState(resolve_parallel_state(state, config))
    model = apply_plans(model, state, config)  # every refusal: the model is untouched until here
    model = apply_pipeline_cut(model, state, config.pipeline)
    model = apply_ep(model, state, config.experts)
    model = apply_tp(model, state, config.tensor)
    model = apply_cp(model, state, config.context)
    model = apply_recompute(model, state, config.recompute)
    model = apply_materialize(model, state)
    model = apply_parallel_class(model, state, config)
    model = apply_zero(model, state, config.zero)
    model = apply_schedule(model, state, config.pipeline)
    return model
