"""parallelize: tensor, sequence and pipeline parallelism for an existing model, in place, by plan.

    state = torchpp.init_parallel(tp=2, pp=1)
    model = parallelize(LlamaForCausalLM(config), state=state)    # the same object, sharded
    out = model(input_ids=ids, labels=ids)                         # transformers' forward and output
    out.loss.backward(); optimizer.step()                          # gradients complete over TP

    state = torchpp.init_parallel(tp=2, pp=2)
    model = parallelize(LlamaForCausalLM(config), schedule="zb-h1", n_microbatches=8, state=state)
    loss = model.step(ids, labels=ids)                             # forward + backward over the pipeline

The model keeps its own forward, modules and parameter names: the plan's linears and embeddings
are sharded in place (``torchpp.tensor_parallel.plan``), and with pp > 1 this rank keeps the
layers of its pipeline stages, each stage running the model's own modules
(``torchpp.models.stages``). transformers models bring their plans; any other module takes
``plan=``.
"""
from __future__ import annotations

import functools
from typing import Dict, List, Mapping, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn

from torchpp import tensor_parallel as tp
from torchpp.expert_parallel.overlap import forward_backward_overlap
from torchpp.models.plans import hf_layout, hf_tp_plan, is_transformers_model, user_plans
from torchpp.models.stages import ModelStage, PipelineLayout, cut_in_place, get_submodule
from torchpp.parallel.groups import ParallelState, get_parallel_state, init_parallel, rank_grid
from torchpp.parallel.zero_params import zero_stage
from torchpp.recompute import check_recompute_mode
from torchpp.tensor_parallel.plan import apply_sequence_parallel, apply_tp_plan, resolve_plan
from torchpp.tensor_parallel.random import TP_RNG_STATE, TP_SEED_OFFSET
from torchpp.tensor_parallel.styles import PlanError, TPContext, install_grad_hooks

IGNORE_INDEX = -100
ATTENTION_WORDS = ("attn", "attention")


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """transformers' causal-LM targets: token t predicts label t+1; the last predicts nothing."""
    return torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, group: Optional[dist.ProcessGroup],
                   vocab_size: int, reduction: str = "mean", shifted: bool = False) -> torch.Tensor:
    """transformers' causal-LM loss (mean over labels != -100) of logits [b, s, V] or of their
    vocabulary slices [b, s, V/t] over ``group`` (never gathered); computed in float32 at least.
    ``shifted``: ``labels`` are the targets already (token t's label t+1, as context parallelism
    shards them)."""
    targets = labels if shifted else shift_labels(labels)
    if group is not None and group.size() > 1:
        return tp.vocab_parallel_cross_entropy(logits, targets, group, ignore_index=IGNORE_INDEX, reduction=reduction,
                                               vocab_size=vocab_size)
    logits = logits[..., :vocab_size]
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    return torch.nn.functional.cross_entropy(logits.flatten(0, -2), targets.flatten(), ignore_index=IGNORE_INDEX,
                                             reduction=reduction)


def layer_bounds(num_layers: int, num_stages: int, split: Optional[Sequence[int]]) -> List[int]:
    """[0, first layer of stage 1, ..., num_layers]; an even division when ``split`` is None."""
    if num_stages > num_layers:
        raise ValueError(f"torchpp.parallelize: {num_stages} pipeline stages need at least {num_stages} "
                         f"layers, the model has {num_layers}")
    if split is None:
        starts = [round(k * num_layers / num_stages) for k in range(1, num_stages)]
    else:
        starts = list(split)
        if len(starts) != num_stages - 1:
            raise ValueError(f"torchpp.parallelize: split={starts} gives {len(starts) + 1} stages, "
                             f"the schedule has {num_stages}")
    bounds = [0] + starts + [num_layers]
    if any(a >= b for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"torchpp.parallelize: split={starts} must be increasing layer indices in "
                         f"(0, {num_layers}) so every stage gets a layer")
    return bounds


def _placement(schedule: str, pp: int, n_microbatches: int, pp_rank: int):
    """(number of model stages, model stages on this rank, pipeline rank of every model stage,
    number of pipelines). DualPipe's two pipelines hold every model stage twice: rank r holds
    stages r and p-1-r, and a stage's rank is that of its pipeline-0 copy, which owns it."""
    if pp == 1:
        return 1, [0], {0: 0}, 1
    from torchpp import schedule as S

    sch = S.generate(schedule, num_ranks=pp, num_microbatches=n_microbatches)
    rank_of: Dict[int, int] = {}
    for stage, rank in enumerate(sch.stage_to_rank):  # pipeline 0's stages come first
        rank_of.setdefault(sch.model_stage(stage), rank)
    mine = sorted({sch.model_stage(s) for s, r in enumerate(sch.stage_to_rank) if r == pp_rank})
    return sch.num_stages // sch.num_pipelines, mine, rank_of, sch.num_pipelines


def _resolve_state(state: Optional[ParallelState], tp_size: Optional[int], pp: Optional[int],
                   cp: Optional[int] = None, ep: Optional[int] = None) -> ParallelState:
    if state is None:
        try:
            state = get_parallel_state()
        except RuntimeError:
            return init_parallel(tp=tp_size or 1, pp=pp or 1, cp=cp or 1, ep=ep or 1)
    asked = {"tp": tp_size, "pp": pp, "cp": cp, "ep": ep}
    if any(size is not None and size != getattr(state, name) for name, size in asked.items()):
        given = ", ".join(f"{name}={size}" for name, size in asked.items() if size is not None)
        held = ", ".join(f"{name}={getattr(state, name)}" for name in asked)
        raise ValueError(f"torchpp.parallelize: {given} disagree with the parallel state ({held}); pass state= "
                         f"or matching sizes")
    return state


def _ensure_tp_rng(state: ParallelState) -> None:
    # Dropout on head-split activations needs the per-TP-rank stream; seed it if the user has not.
    tracker = tp.get_rng_tracker()
    if TP_RNG_STATE not in tracker.get_states():
        tracker.add(TP_RNG_STATE, torch.initial_seed() % 2**31 + TP_SEED_OFFSET + state.tp_rank)


def _end_ranks_group(state: ParallelState, first_rank: int, last_rank: int) -> Optional[dist.ProcessGroup]:
    """The group of two pipeline ranks (the first and last stages') with this rank's (dp, tp)
    coordinates; collective: every rank creates every such group."""
    grid = rank_grid(state.tp, state.pp, state.dp, state.order)
    mine = None
    for d in range(state.dp):
        for t in range(state.tp):  # every rank creates every group, in the same order
            ranks = [int(grid[first_rank, d, t]), int(grid[last_rank, d, t])]
            group = dist.new_group(ranks)
            if dist.get_rank() in ranks:
                mine = group
    return mine


def _check_aux_loss(state: ParallelState, sequence_parallel: bool) -> None:
    """The MoE load-balancing loss (output_router_logits=True) where torchpp can keep it exact."""
    if state.pp > 1 and sequence_parallel and state.tp > 1:  # each router would count its sequence slice alone
        raise NotImplementedError(f"torchpp.parallelize: the MoE load-balancing loss (output_router_logits=True) under "
                                  f"a pipeline (pp={state.pp}) is not supported with sequence_parallel=True and "
                                  f"tp={state.tp}")
    if state.cp > 1:  # transformers adds it to each cp rank's loss, which the cp sum would count c times
        raise NotImplementedError(f"torchpp.parallelize: the MoE load-balancing loss (output_router_logits=True) "
                                  f"is not supported with cp={state.cp}")


def _config(model: nn.Module):
    config = getattr(model, "config", None)
    return config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config


def _tp_context(model: nn.Module, state: ParallelState, sequence_parallel: bool, split_bw: bool) -> TPContext:
    config = _config(model)
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None)
    if head_dim is None and heads and getattr(config, "hidden_size", None):
        head_dim = config.hidden_size // heads
    return TPContext(state.tp_group, sequence_parallel=sequence_parallel, split_bw=split_bw,
                     num_heads=heads if isinstance(heads, int) else None,
                     num_kv_heads=kv_heads if isinstance(kv_heads, int) else None,
                     head_dim=head_dim if isinstance(head_dim, int) else None)


def _check_heads(resolved: Mapping[str, str], ctx: TPContext) -> None:
    """Head-split attention needs whole query heads per rank (key/value heads: whole or copied)."""
    splits_heads = any(style in ("colwise", "packed_colwise", "packed3_colwise")
                       and any(word in name for word in ATTENTION_WORDS) for name, style in resolved.items())
    heads, t = ctx.num_heads, ctx.size
    if splits_heads and heads and heads % t:
        raise PlanError(f"torchpp.parallelize: tp={t} does not divide num_attention_heads={heads} (each tensor-"
                        f"parallel rank holds whole attention heads)")
    kv = ctx.num_kv_heads
    if splits_heads and kv and kv % t and t % kv:
        raise PlanError(f"torchpp.parallelize: tp={t} must divide num_key_value_heads={kv} or be a multiple of it "
                        f"(each rank holds whole key/value heads, copies of them when tp exceeds their number)")


def _attention_dropout(model: nn.Module) -> bool:
    config = _config(model)
    return any(float(getattr(config, key, 0.0) or 0.0) > 0 for key in ("attention_dropout", "attn_pdrop"))


def _local_kv_groups(model: nn.Module, ctx: TPContext) -> None:
    """Attention whose key/value heads are copied (tp exceeds them) holds one of them per rank
    for its num_heads / tp query heads: transformers' repeat_kv reads ``num_key_value_groups``."""
    for module in model.modules():
        if hasattr(module, "num_key_value_groups") and any(
                getattr(getattr(child, "weight", None), "tp_replicas", 1) > 1 for child in module.children()):
            module.num_key_value_groups = ctx.num_heads // ctx.size


def _tied_parameters(model: nn.Module) -> List[nn.Parameter]:
    """Parameters that more than one module holds (a tied input and output embedding)."""
    holders: Dict[int, int] = {}
    params: Dict[int, nn.Parameter] = {}
    for _, module in model.named_modules(remove_duplicate=False):
        for param in module.parameters(recurse=False):
            holders[id(param)] = holders.get(id(param), 0) + 1
            params[id(param)] = param
    return [params[k] for k, n in holders.items() if n > 1]


def _tied_names(model: nn.Module) -> Dict[str, str]:
    """{second name of a tied parameter: its first name} (a tied head: its embedding's name),
    which checkpoints read and write once."""
    first: Dict[int, str] = {}
    aliases: Dict[str, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases[name] = first[id(param)]
        else:
            first[id(param)] = name
    return aliases


def _rebuild_meta_buffers(model: nn.Module, device: torch.device) -> None:
    """Buffers a model built on the meta device left there (rotary frequencies, embedding
    scales: computed at construction, never saved): a transformers model's own initialisation
    (``_init_weights``) computes them again, as from_pretrained does."""
    init = getattr(model, "_init_weights", None)
    for name, module in model.named_modules():
        stale = [b for b, buffer in module.named_buffers(recurse=False) if buffer.is_meta]
        if not stale:
            continue
        if init is None:
            raise ValueError(f"torchpp.parallelize: buffers {stale} of {name} are on the meta device; build the model "
                             f"on the meta device but call parallelize outside that context")
        for b in stale:
            module._buffers[b] = torch.empty_like(module._buffers[b], device=device)
        for attr in ("original_inv_freq",):  # rotary modules keep a plain-tensor copy too
            if isinstance(getattr(module, attr, None), torch.Tensor) and getattr(module, attr).is_meta:
                setattr(module, attr, torch.empty_like(getattr(module, attr), device=device))
        with torch.no_grad():
            init(module)


def _materialize(model: nn.Module, device: torch.device) -> bool:
    from torchpp.models.hf_checkpoint import materialize_meta

    _rebuild_meta_buffers(model, device)  # what _init_weights does to meta parameters does nothing
    return materialize_meta(model, device)


def _full_recompute(layers: Sequence[nn.Module]) -> None:
    """Checkpoints each layer's forward (the hooks of its __call__ stay outside the recomputation)."""
    from torchpp import recompute

    for layer in layers:
        layer.forward = functools.partial(recompute.checkpoint, layer.forward)


class _ParallelMixin:
    """What ``parallelize`` adds to a model (its class becomes a subclass of its own class and
    this one, as FSDP2's fully_shard does, so isinstance, the forward and the names stay)."""

    parallel_state: ParallelState
    schedule = None
    pipeline_stages: Optional[List[nn.Module]] = None
    stage_indices: List[int]
    embedding_group: Optional[dist.ProcessGroup] = None
    loss_group: Optional[dist.ProcessGroup] = None
    grad_scaler = None
    weights_pending = False

    @property
    def tp_group(self) -> dist.ProcessGroup:
        return self.parallel_state.tp_group

    @property
    def state(self) -> ParallelState:  # the name torchpp's other modules use
        return self.parallel_state

    @property
    def has_first_stage(self) -> bool:
        return 0 in self.stage_indices

    @property
    def has_last_stage(self) -> bool:
        return self._num_model_stages - 1 in self.stage_indices

    def _check_loaded(self) -> None:
        if self.weights_pending:
            raise RuntimeError("torchpp: the model was wrapped from the meta device and holds no weights yet; fill it "
                               "with torchpp.models.load_hf_weights(model, checkpoint) first")

    def _check_pipelined(self, call: str) -> None:
        if self.schedule is None:
            return
        raise RuntimeError(f"torchpp: a pipelined model (pp={self.parallel_state.pp}) holds only its stages; {call} "
                           f"runs through model.step(...) (forward + backward) or model.eval_step(...)")

    @property
    def tied_weight(self) -> Optional[nn.Parameter]:
        """This rank's copy of an embedding tied to the output layer on another stage (its
        gradient is summed across the two stages after backward), or None."""
        return getattr(self, "_tied_copy", None) if self.embedding_group is not None else None

    def _share_summed_grads(self) -> None:
        # A tied embedding's gradient left by an earlier step was summed over its two stages: count it once.
        tied = self.tied_weight
        if tied is not None:
            tp.share_summed_grads([tied], self.embedding_group.size())

    def finish_grads(self) -> None:
        """Sums a tied embedding's gradients over the first and last stage (called by ``step``,
        which accumulates over several calls; after a custom backward call it yourself, once per
        optimizer step). Gradients of TP-replicated parameters are complete after every backward."""
        tied = self.tied_weight
        if tied is not None:
            if tied.grad is None:
                tied.grad = torch.zeros_like(tied)
            dist.all_reduce(tied.grad, group=self.embedding_group)

    @torch.no_grad()
    def full_state_dict(self, grads: bool = False) -> Dict[str, torch.Tensor]:
        """This rank's parameters (or their gradients) as the unsharded model's full tensors, by
        their names (a tied one under each of its names). Collective over the TP group (and the
        expert-parallel group, for expert parameters).

        Args:
            grads: return gradients (zeros where none) instead of values.
        """
        out: Dict[str, torch.Tensor] = {}
        group = self.tp_group
        gathered: Dict[int, torch.Tensor] = {}
        for name, param in self.named_parameters(remove_duplicate=False):
            if id(param) not in gathered:
                local = param.grad if grads else param
                local = torch.zeros_like(param) if local is None else local.detach().contiguous()
                layout = getattr(param, "tp_layout", None)
                if layout is not None and layout.dim is not None and group.size() > 1:
                    shards = [torch.empty_like(local) for _ in range(group.size())]
                    dist.all_gather(shards, local, group=group)
                    local = layout(shards)
                experts = getattr(param, "expert_parallel", None)  # (ep group, rank, size): whole experts
                if experts is not None and experts[2] > 1:
                    shards = [torch.empty_like(local) for _ in range(experts[2])]
                    dist.all_gather(shards, local, group=experts[0])
                    local = torch.cat(shards)
                gathered[id(param)] = local
            out[name] = gathered[id(param)]
        return out

    hf_state_dict = full_state_dict


class ParallelCausalLM(_ParallelMixin):
    """A transformers causal LM under ``parallelize``: its own forward (pp=1) plus ``step``."""

    vocab_parallel_logits = False
    context_parallel = None  # torchpp.context_parallel.hf.ContextParallel when cp > 1
    # Under a pipeline with output_router_logits: the stages carry the router statistics and
    # ``aux_loss`` holds the last step's load-balancing loss (last-stage ranks, else None).
    carries_router_load = False
    aux_loss: Optional[torch.Tensor] = None

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """All-gathers vocab-parallel logits (``vocab_parallel_logits=True``) over TP, padding dropped."""
        from torchpp import ops

        vocab = _config(self).vocab_size
        if logits.size(-1) == vocab:
            return logits
        return ops.gather_from_tp_region(logits, self.tp_group, dim=-1)[..., :vocab]

    def __call__(self, *args, **kwargs):
        self._check_pipelined("calling the model")
        self._check_loaded()
        cp = self.context_parallel
        if cp is None:
            return super().__call__(*args, **kwargs)
        # Every cp rank holds the full batch: run on this rank's shard of the sequence. The logits
        # stay sharded (torchpp.context_parallel.unshard_sequence gathers them); the loss is the batch's.
        if args:
            raise TypeError("torchpp: a context-parallel model takes its inputs by keyword (input_ids=..., labels=...)")
        from torchpp.context_parallel.hf import shard_batch

        if kwargs.get("use_cache"):
            raise ValueError("torchpp: a context-parallel model holds a shard of each sequence and keeps no key/value "
                             "cache; call it with use_cache=False (the default under cp)")
        kwargs["use_cache"] = False  # as training runs it: transformers then honours packed position ids too
        batch = {k: kwargs.pop(k, None) for k in ("input_ids", "inputs_embeds", "labels", "shift_labels",
                                                  "position_ids", "attention_mask")}
        out = super().__call__(**shard_batch(cp, **batch), **kwargs)
        if getattr(out, "loss", None) is not None:
            out.loss = cp.sum_over_ranks(out.loss)
        return out

    def _lm_group(self) -> Optional[dist.ProcessGroup]:
        head = self.get_output_embeddings()
        tp_conf = getattr(head, "tp", None)
        return self.tp_group if tp_conf is not None and tp_conf.column else None

    def _vocab_parallel_loss(self, logits, labels, vocab_size=None, num_items_in_batch=None, ignore_index=IGNORE_INDEX,
                             shift_labels=None, **kwargs):
        """transformers' ForCausalLMLoss on vocab-parallel logits (``vocab_parallel_logits=True``)."""
        if shift_labels is not None:
            labels = torch.nn.functional.pad(shift_labels, (1, 0), value=ignore_index)
        vocab = vocab_size or _config(self).vocab_size
        if num_items_in_batch is None:
            return causal_lm_loss(logits, labels, self._lm_group(), vocab)
        return causal_lm_loss(logits, labels, self._lm_group(), vocab, reduction="sum") / num_items_in_batch

    def _microbatch_loss(self, output, labels: torch.Tensor) -> torch.Tensor:
        # The schedule weights a microbatch by its share of rows; dividing that back out and
        # summing over the batch's labelled tokens makes the total exactly the batch mean,
        # even when microbatches hold different numbers of ignored labels.
        logits, load = (output[0], output[1:]) if isinstance(output, tuple) else (output, ())
        total = causal_lm_loss(logits, labels, self._lm_group(), _config(self).vocab_size, reduction="sum",
                               shifted=self.context_parallel is not None)
        loss = total / self._batch_tokens * (self._batch_rows / labels.size(0))
        if not load:
            return loss
        # The load-balancing loss of this microbatch over every data-parallel rank's rows, not
        # rescaled: the schedule's weight makes the batch's sum_m w_m * coef * aux_m.
        aux = self._microbatch_aux_loss(*load)
        self._aux_parts.append(aux.detach() * (labels.size(0) / self._batch_rows))
        return loss + self.router_aux_loss_coef * aux.to(loss.device)

    def _microbatch_aux_loss(self, counts: torch.Tensor, prob_sum: torch.Tensor) -> torch.Tensor:
        """transformers' load_balancing_loss_func of one microbatch over the data-parallel ranks
        from the statistics its stages carried. The probability sums are all-gathered (their
        gradient reduce-scattered: each rank's router gets the gradient of its own tokens times
        dp, which the data-parallel average divides back out, as torchpp.expert_parallel.aux_loss)."""
        from torchpp import ops
        from torchpp.expert_parallel.router_load import load_balancing_loss

        group = self.parallel_state.dp_group
        if group is not None and group.size() > 1:
            counts = ops.reduce_from_tp_region(counts, group)
            prob_sum = ops.gather_from_sp_region(prob_sum.unsqueeze(0), group, dim=0).sum(0)
        return load_balancing_loss(counts, prob_sum)

    def step(self, input_ids: Optional[torch.Tensor] = None, labels: Optional[torch.Tensor] = None,
             losses: Optional[list] = None, attention_mask: Optional[torch.Tensor] = None,
             position_ids: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """Forward and backward of one batch; gradients accumulate in ``.grad`` and are complete
        over TP and tied embeddings on return (data-parallel reduction is separate).

        Args:
            input_ids: [b, s] tokens, on ranks holding the first stage.
            labels: [b, s] labels (transformers' convention: unshifted, -100 ignored), on ranks
                holding the last stage.
            losses: if a list, per-microbatch losses are appended (last-stage ranks; under
                DualPipe each end rank has its pipeline's half); under a pipeline each is its
                tokens' loss sum over the batch's labelled tokens, divided by the microbatch's
                share of rows (plus, with ``output_router_logits``, ``router_aux_loss_coef``
                times the microbatch's load-balancing loss), so their share-weighted sum is the
                batch loss.
            attention_mask: [b, s], 1 for tokens and 0 for padding, on ranks holding the first
                stage; it travels down the pipeline with the hidden states.
            position_ids: [b, s] (or [1, s]) positions, on ranks holding the first stage;
                positions that restart within a row (without an attention_mask) pack several
                sequences, as transformers reads them.

        Returns:
            The batch's mean loss on ranks holding the last stage (DualPipe: both end ranks),
            else None. A non-finite loss is returned as it is. Under a pipeline with
            ``output_router_logits``, ``model.aux_loss`` then holds the batch's load-balancing
            loss (sum_m w_m aux_m) on those ranks.
        """
        self._check_loaded()
        if self.schedule is None:
            out = self(input_ids=input_ids, labels=labels, attention_mask=attention_mask, position_ids=position_ids,
                       use_cache=False)
            loss = out.loss
            scaler = self.grad_scaler
            self._share_summed_grads()
            (scaler.scale(loss) if scaler is not None and scaler.is_enabled() else loss).backward()
            if losses is not None:
                losses.append(loss.detach())
            result = loss.detach()
        else:
            self._share_summed_grads()  # a failed pipeline step breaks its groups: no undo needed
            result = self._pipeline_loss(self.schedule.step, input_ids, labels, losses, attention_mask, position_ids)
        self.finish_grads()
        return result

    def eval_step(self, input_ids: Optional[torch.Tensor] = None, labels: Optional[torch.Tensor] = None,
                  losses: Optional[list] = None, attention_mask: Optional[torch.Tensor] = None,
                  position_ids: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """The batch's mean loss without a backward (validation); no gradient is touched.
        Arguments and result as ``step``. (Call ``model.eval()`` first to turn dropout off.)"""
        self._check_loaded()
        if self.schedule is not None:
            return self._pipeline_loss(self.schedule.eval, input_ids, labels, losses, attention_mask, position_ids)
        with torch.no_grad():
            loss = self(input_ids=input_ids, labels=labels, attention_mask=attention_mask, position_ids=position_ids,
                        use_cache=False).loss
        if losses is not None:
            losses.append(loss)
        return loss

    def _pipeline_loss(self, run, input_ids, labels, losses, attention_mask, position_ids) -> Optional[torch.Tensor]:
        """Runs ``run`` (the schedule's step or eval) over the batch; the batch loss on ranks
        holding the last stage, else None."""
        from torchpp.pipeline.microbatch import loss_weights, split_microbatches

        mine: list = []
        self._aux_parts = []
        if self.has_last_stage and labels is not None:  # missing labels: the schedule raises on every rank
            self._batch_rows = labels.size(0)
            self._batch_tokens = int((shift_labels(labels) != IGNORE_INDEX).sum().clamp(min=1))
        cp = self.context_parallel
        if cp is not None:  # every cp rank holds the full batch: keep this rank's shard of the sequence
            input_ids, labels, position_ids, attention_mask = self._shard_for_pipeline(
                cp, input_ids, labels, position_ids, attention_mask)
        ids, extras = [], {}
        if self.has_first_stage:
            ids = [input_ids]
            extras = dict(attention_mask=attention_mask,
                          position_ids=None if position_ids is None else position_ids.expand_as(input_ids))
            extras = {k: v for k, v in extras.items() if v is not None}
        run(*ids, **extras, target=labels if self.has_last_stage else None, losses=mine)
        if cp is not None and mine:  # each cp rank holds its tokens' part of every microbatch's loss
            parts = torch.stack([loss.detach() for loss in mine])
            dist.all_reduce(parts, group=cp.group)
            mine = list(parts.unbind())
        if losses is not None:
            losses.extend(mine)
        if self.carries_router_load:
            self.aux_loss = self._batch_aux_loss()
        if not mine:
            return None
        weights = loss_weights(split_microbatches(labels, self.schedule.num_microbatches))
        computed_here = self.schedule.schedule.loss_microbatches(self.schedule.rank)
        loss = sum(weights[k] * microbatch_loss for k, microbatch_loss in zip(computed_here, mine))
        if self.loss_group is not None:  # DualPipe: each end rank computed its pipeline's half
            dist.all_reduce(loss, group=self.loss_group)
        return loss


    def _batch_aux_loss(self) -> Optional[torch.Tensor]:
        """The batch's load-balancing loss, sum_m w_m aux_m (ranks holding the last stage)."""
        if not self.has_last_stage or not self._aux_parts:
            return None
        aux = torch.stack(self._aux_parts).sum()
        if self.loss_group is not None:  # DualPipe: each end rank computed its pipeline's half
            dist.all_reduce(aux, group=self.loss_group)
        return aux

    def _shard_for_pipeline(self, cp, input_ids, labels, position_ids, attention_mask):
        """(input_ids, shifted targets, position ids, None): this rank's shard of the sequence."""
        from torchpp.context_parallel.hf import shard_batch

        if self.has_first_stage:
            batch = shard_batch(cp, input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask)
            input_ids, position_ids = batch["input_ids"], batch["position_ids"]
        if self.has_last_stage and labels is not None:
            labels = cp.shard(shift_labels(labels))
        return input_ids, labels, position_ids, None


class ParallelModule(_ParallelMixin):
    """Any other module under ``parallelize``: its own forward (pp=1) plus ``step``."""

    loss_fn = None

    def __call__(self, *args, **kwargs):
        self._check_pipelined("calling the model")
        return super().__call__(*args, **kwargs)

    def step(self, *args, target=None, losses: Optional[list] = None, **kwargs):
        """Forward and backward of one batch with ``parallelize``'s ``loss_fn(output, target)``;
        returns the loss (the last stage's, under a pipeline; None elsewhere)."""
        if self.loss_fn is None:
            raise ValueError("torchpp: step() needs parallelize(..., loss_fn=loss_fn(output, target))")
        if self.schedule is None:
            loss = self.loss_fn(super().__call__(*args, **kwargs), target)
            loss.backward()
            if losses is not None:
                losses.append(loss.detach())
            result = loss.detach()
        else:
            self._share_summed_grads()
            mine: list = []
            self.schedule.step(*args, target=target, losses=mine, return_outputs=False, **kwargs)
            if losses is not None:
                losses.extend(mine)
            result = None
            if mine:
                from torchpp.pipeline.microbatch import loss_weights, split_microbatches

                weights = loss_weights(split_microbatches(target, self.schedule.num_microbatches))
                computed_here = self.schedule.schedule.loss_microbatches(self.schedule.rank)
                result = sum(weights[k] * loss for k, loss in zip(computed_here, mine))
        self.finish_grads()
        return result


def _swap_model_class(model: nn.Module, mixin: type) -> None:
    cls = type(model)
    if issubclass(cls, _ParallelMixin):
        raise ValueError(f"torchpp.parallelize: {cls.__name__} is parallelized already")
    model.__class__ = type(f"Parallel{cls.__name__}", (mixin, cls), {"__module__": cls.__module__})


def parallelize(
    model: nn.Module,
    tp: Optional[int] = None,
    pp: Optional[int] = None,
    schedule: str = "1f1b",
    n_microbatches: Optional[int] = None,
    *,
    plan: Optional[Mapping] = None,
    sequence_parallel: bool = False,
    recompute: Optional[str] = None,
    split: Optional[Union[Sequence[int], str]] = None,
    state: Optional[ParallelState] = None,
    grad_scaler=None,
    vocab_parallel_logits: bool = False,
    loss_fn=None,
    split_bw: Optional[bool] = None,
    cp: Optional[int] = None,
    cp_mode: str = "ring",
    cp_layout: str = "zigzag",
    ep: Optional[int] = None,
    capacity_factor: Optional[float] = None,
    expert_tensor_parallel: bool = False,
    zero: Union[bool, int] = 0,
    overlap_forward_backward: Optional[bool] = None,
) -> nn.Module:
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
        model: a transformers model (with plans), or any nn.Module with ``plan``; identical on
            every rank, or built on the meta device (``load_hf_weights`` then fills the shards).
        tp: tensor-parallel size (default: the parallel state's).
        pp: pipeline-parallel size (default: the parallel state's).
        schedule: pipeline schedule name (torchpp.schedule.SCHEDULES) when pp > 1. DualPipe runs
            two pipelines in opposite directions: rank r holds model stages r and p-1-r, ``step``
            sums each stage's gradients over its two ranks, and both end ranks hold the loss.
        n_microbatches: microbatches per step (default: pp).
        plan: a dict of module/parameter-name globs to style names
            (``torchpp.tensor_parallel.styles.STYLES``), or {"tp": {...}, "pp": {...}} where the
            pp part names the stack of layers (transformers' form, or module names in the order
            they run). Default: the transformers model's own plans.
        sequence_parallel: the residual stream and norms hold sequence slices (Megatron-3).
        recompute: None, "full" (checkpoint each layer) or, for transformers models, "selective"
            (recompute the attention function: the s x s scores and probabilities).
        split: first layer index of each model stage after the first; default even; "auto": a
            quick profile and torchpp.plan's partitioner choose it, and the cost-aware schedules
            (zb-auto, zb-v) are generated on the profiled per-stage F, I and W times.
        state: the ParallelState (default: the current one, or init_parallel(tp, pp)).
        grad_scaler: fp16 loss scaling (torchpp.parallel.GradScaler); give it to
            DistributedOptimizer too.
        vocab_parallel_logits: (transformers causal LMs, pp=1) return each rank's vocabulary
            slice of the logits and compute the loss on the slices.
        loss_fn: ``loss_fn(output, target)`` of ``step`` for a model that is not a transformers
            causal LM.
        split_bw: whether the plain ``nn.Linear`` layers the plan leaves unsharded (and any
            ``nn.MultiheadAttention``) run their backward split into I and W
            (``PipelineStage(split_bw=)``): None (default) on under schedules with W passes,
            so those passes carry their weight gradients; False keeps their backward in I.
        cp: context-parallel size (default: the parallel state's), transformers causal LMs: every
            rank of a cp group is given the same full batch and runs on its shard of the
            sequence (``cp_layout`` chunks), attention exchanging keys and values over the group
            (``cp_mode``: "ring" or "all-gather"; torchpp.context_parallel). Logits stay
            sharded (``torchpp.context_parallel.unshard_sequence`` gathers them); the loss is
            the batch's; gradients are this rank's part, summed over cp by DistributedOptimizer.
        cp_mode: "ring" (key/value shards passed around the ring, overlapping compute) or
            "all-gather".
        cp_layout: "zigzag" (rank r holds chunks r and 2c-1-r of 2c: causal work balanced) or
            "contiguous".
        ep: expert-parallel size (default: the parallel state's): each rank of ``state.ep_group``
            holds E/ep whole experts of every MoE layer (the model's ``base_model_ep_plan``), tokens
            reach them by all-to-all (torchpp.expert_parallel); the routers stay replicated. Each
            data-parallel rank feeds its own batch slice; with ``output_router_logits`` the
            load-balancing loss is the whole batch's (router logits all-gathered over dp x cp). Under
            a pipeline (pp > 1) it is per microbatch, as under gradient accumulation: microbatch
            m's loss adds ``router_aux_loss_coef`` times transformers' aux loss of the m-th
            microbatch of every data-parallel rank (router statistics travel down the pipeline
            with the hidden states, torchpp.expert_parallel.router_load); ``model.aux_loss`` then
            holds the batch's, sum_m w_m aux_m, on last-stage ranks.
        capacity_factor: None (dropless, default) or each expert's capacity as a factor of an even
            share of a rank's routed pairs; dropped pairs per experts module: ``model.ep_dropped``.
        expert_tensor_parallel: with tp > 1 and ep > 1, also split each expert over TP (the TP plan's
            expert entries); default False: whole experts, replicated over TP.
        overlap_forward_backward: (pp > 1) run each forward and the backward of another
            microbatch next to it in the schedule at once (DualPipe's overlapped pairs), so the
            experts' all-to-all of one waits while the other computes
            (torchpp.expert_parallel.overlap). None (default): on under dualpipe / dualpipe-v
            with ep > 1 on CPU when tp = cp = 1 and zero <= 1; True insists (errors name what
            stands in the way); False: off.
        zero: the ZeRO stage (0..3; True is 1) that ``DistributedOptimizer(model, ...)`` then
            applies over dp (``model.zero_stage``); at 3 that optimizer shards the parameters
            and gathers each bucket before its first forward in a step.

    Returns:
        ``model`` itself, parallelized.
    """
    check_recompute_mode(recompute)
    zero = zero_stage(zero)
    state = _resolve_state(state, tp, pp, cp, ep)
    _ensure_tp_rng(state)
    overlap = forward_backward_overlap(state, schedule, overlap_forward_backward, zero)  # errors before any change
    hf = is_transformers_model(model)
    fixups = None
    if plan is not None:
        tp_plan, layout = user_plans(model, plan)
        if layout is None and hf:
            layout = hf_layout(model)
    elif hf:
        tp_plan, fixups = hf_tp_plan(model)
        layout = hf_layout(model)
    else:
        raise PlanError(f"torchpp.parallelize: {type(model).__name__} is not a transformers model; pass plan= (a dict "
                        f"of module-name globs to styles, e.g. {{'blocks.*.fc1': 'colwise', 'blocks.*.fc2': 'rowwise'}})")
    causal_lm = hf and model.get_output_embeddings() is not None
    if getattr(_config(model), "output_router_logits", False):  # before anything changes
        _check_aux_loss(state, sequence_parallel)
    if state.cp > 1 and not causal_lm:
        raise PlanError(f"torchpp.parallelize: cp={state.cp} shards the sequence of a transformers causal LM; "
                        f"{type(model).__name__} is not one (use torchpp.context_parallel's ops in your own model)")
    if vocab_parallel_logits and not causal_lm:
        raise ValueError("torchpp.parallelize: vocab_parallel_logits=True needs a transformers causal LM")
    if state.pp > 1 and layout is None:
        raise PlanError(f"torchpp.parallelize: pp={state.pp} needs a stack of layers to cut: {type(model).__name__} "
                        f"has no base_model_pp_plan; pass plan={{'tp': ..., 'pp': [...]}}")
    n_microbatches = n_microbatches or state.pp
    num_stages, mine, rank_of, num_pipelines = _placement(schedule, state.pp, n_microbatches, state.pp_rank)
    strict = plan is not None
    ctx = _tp_context(model, state, sequence_parallel, split_bw=state.pp > 1)
    ep_plan = None
    if state.ep > 1 or capacity_factor is not None:  # bad ep plans raise before anything changes
        from torchpp.expert_parallel.plan import expert_plans

        ep_plan, tp_plan = expert_plans(model, state, tp_plan, expert_tensor_parallel, capacity_factor)
    if state.tp > 1:  # bad plans and head counts raise before anything changes
        _check_heads(resolve_plan(model, tp_plan, strict), ctx)

    # ---- pipeline: keep this rank's stages ----
    tied = _tied_parameters(model)
    tied_names = _tied_names(model)
    stages: Dict[int, ModelStage] = {}
    num_layers = len(get_submodule(model, layout.layers)) if layout is not None else 0
    stage_costs = None  # split="auto": the profiled per-stage F, I, W the cost-aware schedules use
    if state.pp > 1:
        if isinstance(split, str) and split == "auto":
            split, stage_costs = _auto_split(model, layout, num_stages, state.pp, rank_of)
        bounds = layer_bounds(num_layers, num_stages, split)
        stages = cut_in_place(model, layout, bounds, mine, hf)

    # ---- experts over the ep group (whole experts), then tensor and sequence parallelism ----
    ep_ctx = None
    if ep_plan is not None:
        from torchpp.expert_parallel import EPContext, apply_ep_plan

        ep_ctx = EPContext(state.ep_group, capacity_factor=capacity_factor)
        apply_ep_plan(model, ep_plan, ep_ctx)
    if hf and state.dp * state.cp > 1 and state.pp == 1:  # under a pipeline the loss sums the carried statistics
        from torchpp.expert_parallel import gather_router_logits

        gather_router_logits(model, state.dp_cp_group or state.dp_group)
    if state.tp > 1:
        apply_tp_plan(model, tp_plan, ctx, strict=False, config=_config(model))
        _local_kv_groups(model, ctx)
        if fixups is not None:
            fixups(model, ctx)
    if sequence_parallel and state.tp > 1:
        if layout is None:
            raise PlanError("torchpp.parallelize: sequence_parallel needs the model's stack of layers (a pp plan)")
        stack = get_submodule(model, layout.layers)
        _apply_sequence_parallel(stack, ctx, num_layers)
    context = None
    if state.cp > 1:
        from torchpp.context_parallel.hf import ContextParallel, apply_context_parallel


        context = ContextParallel(state.cp_group, cp_mode, cp_layout)
        apply_context_parallel(model, context, recompute_core=recompute == "selective")
    elif hf and (recompute == "selective" or (state.tp > 1 and _attention_dropout(model))):
        from torchpp.models.attention import wrap_attention

        wrap_attention(model, recompute_core=recompute == "selective")
    elif recompute == "selective":
        raise PlanError("torchpp.parallelize: recompute='selective' recomputes a transformers model's attention "
                        "function; for another model use recompute='full'")
    if recompute == "full":
        if layout is None:
            raise PlanError("torchpp.parallelize: recompute='full' checkpoints each layer of the stack (a pp plan)")
        _full_recompute([m for m in get_submodule(model, layout.layers) if m.__class__.__name__ != "ElsewhereLayer"])

    # ---- the wrapped model ----
    pending = _materialize(model, state.device)
    model.to(state.device)
    install_grad_hooks(model, ctx)  # on the parameters' final storage
    _swap_model_class(model, ParallelCausalLM if causal_lm else ParallelModule)
    model.parallel_state = state
    model._tp_context = ctx
    model.weights_pending = pending
    model.stage_indices = mine
    model.tied_names = tied_names
    model._num_model_stages = num_stages
    model.grad_scaler = grad_scaler
    if context is not None:
        object.__setattr__(model, "context_parallel", context)
    if ep_ctx is not None:
        model.ep_dropped = ep_ctx.dropped
    model.zero_stage = zero
    for param in model.parameters():  # DistributedOptimizer(zero=None) reads it from what it is given
        param.zero_stage = zero
    if not causal_lm:  # not a submodule, even when the loss is an nn.Module
        object.__setattr__(model, "loss_fn", loss_fn)
    if causal_lm and vocab_parallel_logits:
        head = model.get_output_embeddings()
        if getattr(head, "tp", None) is not None:
            head.tp.gather_output = False
        model.vocab_parallel_logits = True
        model.loss_function = model._vocab_parallel_loss

    first, last = 0, num_stages - 1
    if state.pp > 1 and causal_lm and getattr(_config(model), "output_router_logits", False):
        _carry_router_load(model, stages)
    if state.pp > 1:
        embedding_tied = [p for p in tied if any(p is q for q in model.parameters())]
        if embedding_tied and rank_of[first] != rank_of[last] and num_pipelines == 1:
            model.embedding_group = _end_ranks_group(state, rank_of[first], rank_of[last])
            object.__setattr__(model, "_tied_copy", embedding_tied[0])  # not registered: a second name
            if last in mine:  # after finish_grads both copies hold the same gradient: count it once
                embedding_tied[0].shared_duplicate = True
        elif tied and rank_of[first] != rank_of[last] and num_pipelines == 1:
            _end_ranks_group(state, rank_of[first], rank_of[last])  # collective: every rank creates it
        if num_pipelines == 2:
            model.loss_group = _end_ranks_group(state, rank_of[first], rank_of[last])
        _build_schedule(model, stages, mine, num_stages, schedule, n_microbatches, state, sequence_parallel,
                        grad_scaler, causal_lm, loss_fn, split_bw, overlap, stage_costs)
    return model


def _carry_router_load(model: nn.Module, stages: Dict[int, ModelStage]) -> None:
    """The stages carry the router statistics of the load-balancing loss, which the last stage's
    loss adds per microbatch (torchpp.expert_parallel.router_load)."""
    from torchpp.expert_parallel.router_load import aux_loss_shape, record_router_load

    shape = aux_loss_shape(model)
    if shape is None:  # a causal LM without transformers' aux loss (DeepSeek-V3's) adds none at pp=1 either
        return
    record_router_load(model)
    for stage in stages.values():
        stage.router_load = shape
    model.carries_router_load = True


def _apply_sequence_parallel(stack: nn.ModuleList, ctx: TPContext, num_layers: int) -> None:
    """Sequence parallelism on this rank's layers of the stack (the stack's ends split and
    gather only where this rank holds the first and last layer)."""
    from torchpp.models.stages import ElsewhereLayer

    held = [i for i in range(num_layers) if not isinstance(stack[i], ElsewhereLayer)]
    apply_sequence_parallel(stack, ctx, layers=held, first=0 in held, last=num_layers - 1 in held)


def _build_schedule(model, stages, mine, num_stages, schedule, n_microbatches, state, sequence_parallel, grad_scaler,
                    causal_lm, loss_fn, split_bw, overlap, costs=None) -> None:
    from torchpp.pipeline import PipelineStage, build_schedule

    pipeline_stages = [PipelineStage(stages[i], i, num_stages, state.device, group=state.pp_group,
                                     tp_group=state.tp_group, split_bw=split_bw) for i in mine]
    # A plain list, not a submodule: the stages' parameters are the model's, under their own names.
    object.__setattr__(model, "pipeline_stages", [stages[i] for i in mine])
    if causal_lm:
        head = model.get_output_embeddings()
        if num_stages - 1 in mine and getattr(head, "tp", None) is not None:
            head.tp.gather_output = False  # the last stage's loss works on vocabulary slices
        loss = model._microbatch_loss
    else:
        loss = loss_fn
    # Sequence-parallel hidden states differ per TP rank, so the pipeline must not split/gather them.
    overlap_forward_backward, overlap_groups = overlap
    model.schedule = build_schedule(schedule, pipeline_stages, n_microbatches, loss_fn=loss, costs=costs,
                                    scatter_gather=not sequence_parallel, grad_scaler=grad_scaler,
                                    overlap_forward_backward=overlap_forward_backward, overlap_groups=overlap_groups)


def _auto_split(model: nn.Module, layout: PipelineLayout, num_stages: int, pp: int, rank_of):
    if any(param.is_meta for param in model.parameters()):
        raise ValueError("torchpp.parallelize: split='auto' times the model's layers, which a meta-device model "
                         "cannot run; give split=[...] or build the model with weights")
    from torchpp.models.auto_split import auto_split

    return auto_split(model, num_stages, pp, rank_of, layout)
