"""parallelize: a Hugging Face causal LM as tensor- and pipeline-parallel stages.

    state = torchpp.init_parallel(tp=2, pp=2)
    model = torchpp.models.parallelize(LlamaForCausalLM(config), schedule="zb-h1", n_microbatches=4)
    loss = model.step(input_ids, labels)      # forward + backward over the pipeline
    optimizer.step()

Supported: LlamaForCausalLM, MistralForCausalLM, MixtralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM,
GemmaForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM, Phi3ForCausalLM, GPT2LMHeadModel (see
docs/ptdp.md for what is and is not).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn

from torchpp import ops
from torchpp import tensor_parallel as tp
from torchpp.models.hf_checkpoint import materialize_meta
from torchpp.models.hf_convert import Export
from torchpp.models.hf_gpt2 import GPT2Family
from torchpp.models.hf_layers import CausalLMStage
from torchpp.models.hf_llama import LlamaFamily
from torchpp.parallel.groups import ParallelState, get_parallel_state, init_parallel, rank_grid
from torchpp.recompute import check_recompute_mode
from torchpp.tensor_parallel.embedding import padded_vocab_size
from torchpp.tensor_parallel.random import TP_RNG_STATE, TP_SEED_OFFSET

FAMILIES = {"llama": LlamaFamily, "mistral": LlamaFamily, "mixtral": LlamaFamily, "qwen2": LlamaFamily,
            "qwen3": LlamaFamily, "gemma": LlamaFamily, "gemma2": LlamaFamily, "gemma3_text": LlamaFamily,
            "phi3": LlamaFamily, "gpt2": GPT2Family}
IGNORE_INDEX = -100


@dataclass
class ConversionContext:
    """What every converted piece shares: TP group and options, and the export records."""

    tp_group: dist.ProcessGroup
    sequence_parallel: bool
    recompute: Optional[str]
    split_bw: bool
    exports: List[Export] = field(default_factory=list)

    @property
    def tp_size(self) -> int:
        return self.tp_group.size()

    def padded_vocab(self, vocab_size: int) -> int:
        return padded_vocab_size(vocab_size, self.tp_size)

    @property
    def linear_kwargs(self) -> dict:
        kwargs = dict(group=self.tp_group, sequence_parallel=self.sequence_parallel, sequence_dim=1)
        # Older TP layers lack split_bw; they then run ordinary backward (W passes do nothing).
        if self.split_bw and "split_bw" in inspect.signature(tp.ColumnParallelLinear.__init__).parameters:
            kwargs["split_bw"] = True
        return kwargs

    @property
    def embedding_kwargs(self) -> dict:
        return dict(group=self.tp_group, sequence_parallel=self.sequence_parallel, sequence_dim=1)


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """transformers' causal-LM targets: token t predicts label t+1; the last predicts nothing."""
    return torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, group, vocab_size: int,
                   reduction: str = "mean") -> torch.Tensor:
    """transformers' causal-LM loss (mean over labels != -100) on vocab-parallel logits
    [b, s, V/t] without gathering them."""
    return tp.vocab_parallel_cross_entropy(
        logits, shift_labels(labels), group, ignore_index=IGNORE_INDEX, reduction=reduction, vocab_size=vocab_size
    )


def layer_bounds(num_layers: int, num_stages: int, split: Optional[Sequence[int]]) -> List[int]:
    """[0, first layer of stage 1, ..., num_layers]; an even division when ``split`` is None."""
    if num_stages > num_layers:
        raise ValueError(f"torchpp.parallelize: {num_stages} pipeline stages need at least {num_stages} "
                         f"decoder layers, the model has {num_layers}")
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


def _resolve_state(state: Optional[ParallelState], tp_size: Optional[int], pp: Optional[int]) -> ParallelState:
    if state is None:
        try:
            state = get_parallel_state()
        except RuntimeError:
            return init_parallel(tp=tp_size or 1, pp=pp or 1)
    if (tp_size or state.tp) != state.tp or (pp or state.pp) != state.pp:
        raise ValueError(f"torchpp.parallelize: tp={tp_size}, pp={pp} disagree with the parallel state "
                         f"(tp={state.tp}, pp={state.pp}); pass state= or matching sizes")
    return state


def _ensure_tp_rng(state: ParallelState) -> None:
    # Attention dropout needs the per-TP-rank stream; seed it if the user has not.
    tracker = tp.get_rng_tracker()
    if TP_RNG_STATE not in tracker.get_states():
        tracker.add(TP_RNG_STATE, torch.initial_seed() % 2**31 + TP_SEED_OFFSET + state.tp_rank)


class ParallelCausalLM(nn.Module):
    """This rank's stages of a wrapped causal LM; built by ``parallelize``.

    ``forward(input_ids)`` (pp=1) returns this rank's vocabulary slice of the logits;
    ``step(input_ids, labels)`` runs forward and backward (over the pipeline when pp > 1) and
    completes the gradients; ``gather_logits`` and ``hf_state_dict`` give HF-layout tensors.
    Each takes ``attention_mask=`` (padding, as transformers' models do).
    """

    def __init__(self, stages: List[CausalLMStage], stage_indices: List[int], state: ParallelState,
                 ctx: ConversionContext, vocab_size: int, embedding_group: Optional[dist.ProcessGroup],
                 loss_group: Optional[dist.ProcessGroup] = None):
        super().__init__()
        self.stages = nn.ModuleList(stages)
        self.stage_indices = stage_indices
        self.state = state
        self.tp_group = ctx.tp_group
        self.vocab_size = vocab_size
        self.exports = ctx.exports
        self.embedding_group = embedding_group
        self.loss_group = loss_group  # DualPipe: the two ranks whose last stages share the batch
        self.schedule = None
        self.grad_scaler = None  # fp16: scales each backward's loss seed (parallelize(grad_scaler=...))
        self._batch_rows = self._batch_tokens = 0
        self.tied_names: Dict[str, str] = {}  # HF name of a tied head -> its embedding's
        self.weights_pending = False  # wrapped from the meta device, not loaded yet
        self.hf_config = None  # the original model's config, written with save_hf_checkpoint

    def _check_loaded(self) -> None:
        if self.weights_pending:
            raise RuntimeError("torchpp: the model was wrapped from the meta device and holds no weights yet; fill it "
                               "with torchpp.models.load_hf_weights(model, checkpoint) first")

    @property
    def has_first_stage(self) -> bool:
        return self.stages[0].embedding is not None

    @property
    def has_last_stage(self) -> bool:
        return any(stage.head is not None for stage in self.stages)

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits [b, s, padded V / t] of this rank's vocabulary slice (pp=1 only)."""
        if self.schedule is not None:
            raise RuntimeError("torchpp: a pipelined model runs through step(input_ids, labels)")
        self._check_loaded()
        return self.stages[0](input_ids, attention_mask, position_ids)

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """transformers' causal-LM loss of vocab-parallel ``logits`` against ``labels`` [b, s]."""
        return causal_lm_loss(logits, labels, self.tp_group, self.vocab_size)

    def _microbatch_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # The schedule weights a microbatch by its share of rows; dividing that back out and
        # summing over the batch's labelled tokens makes the total exactly HF's batch mean,
        # even when microbatches hold different numbers of ignored labels.
        total = causal_lm_loss(logits, labels, self.tp_group, self.vocab_size, reduction="sum")
        return total / self._batch_tokens * (self._batch_rows / labels.size(0))

    def step(self, input_ids: Optional[torch.Tensor] = None, labels: Optional[torch.Tensor] = None,
             losses: Optional[list] = None, attention_mask: Optional[torch.Tensor] = None,
             position_ids: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """Forward and backward of one batch; gradients accumulate in ``.grad`` and are complete
        over TP and tied embeddings on return (data-parallel reduction is separate).

        Args:
            input_ids: [b, s] tokens, on ranks holding the first stage.
            labels: [b, s] labels (HF convention: unshifted, -100 ignored), on ranks holding the
                last stage.
            losses: if a list, per-microbatch losses are appended (last-stage ranks; under
                DualPipe each end rank has its pipeline's half); under a pipeline each is its
                tokens' loss sum over the batch's labelled tokens, divided by the microbatch's
                share of rows, so their share-weighted sum is the batch loss.
            attention_mask: [b, s], 1 for tokens and 0 for padding, on ranks holding the first
                stage; it travels down the pipeline with the hidden states. As in
                transformers, it only hides keys: give padding the label -100.
            position_ids: [b, s] (or [1, s]) positions, on ranks holding the first stage;
                default 0..s-1. Without an attention_mask, positions that restart within a
                row mark packed sequences, each attending only to itself (transformers' rule
                in training).

        Returns:
            The batch's mean loss on ranks holding the last stage (DualPipe: both end
            ranks), else None.
        """
        self._check_loaded()
        if self.schedule is None:
            loss = self.loss(self(input_ids, attention_mask, position_ids), labels)
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
        """The batch's mean loss without a backward (validation): forward only, over the
        pipeline's ``eval``; no gradient is touched. Arguments and result as ``step``. (Call
        ``model.eval()`` first to turn dropout off, as for any module.)"""
        self._check_loaded()
        if self.schedule is not None:
            return self._pipeline_loss(self.schedule.eval, input_ids, labels, losses, attention_mask, position_ids)
        with torch.no_grad():
            loss = self.loss(self(input_ids, attention_mask, position_ids), labels)
        if losses is not None:
            losses.append(loss)
        return loss

    def _pipeline_loss(self, run, input_ids, labels, losses, attention_mask, position_ids) -> Optional[torch.Tensor]:
        """Runs ``run`` (the schedule's step or eval) over the batch; the batch loss on ranks
        holding the last stage, else None."""
        from torchpp.pipeline.microbatch import loss_weights, split_microbatches

        mine: list = []
        if self.has_last_stage and labels is not None:  # missing labels: the schedule raises on every rank
            self._batch_rows = labels.size(0)
            self._batch_tokens = int((shift_labels(labels) != IGNORE_INDEX).sum().clamp(min=1))
        # Mask and positions are the first stage's keyword arguments, split into microbatches
        # with the ids (positions given for one row apply to every row).
        ids, extras = [], {}
        if self.has_first_stage:
            ids = [input_ids]
            extras = dict(attention_mask=attention_mask,
                          position_ids=None if position_ids is None else position_ids.expand_as(input_ids))
            extras = {k: v for k, v in extras.items() if v is not None}
        run(*ids, **extras, target=labels if self.has_last_stage else None, losses=mine)
        if losses is not None:
            losses.extend(mine)
        if not mine:
            return None
        # The schedule's weights make the microbatch losses add up to the batch's.
        weights = loss_weights(split_microbatches(labels, self.schedule.num_microbatches))
        computed_here = self.schedule.schedule.loss_microbatches(self.schedule.rank)
        loss = sum(weights[k] * microbatch_loss for k, microbatch_loss in zip(computed_here, mine))
        if self.loss_group is not None:  # DualPipe: each end rank computed its pipeline's half
            dist.all_reduce(loss, group=self.loss_group)
        return loss

    @property
    def tied_weight(self) -> Optional[nn.Parameter]:
        """This rank's copy of an embedding tied to the output layer on another stage (its
        gradient is summed across the two stages after backward), or None."""
        if self.embedding_group is None:
            return None
        return self.stages[0].embedding.tokens.weight if self.has_first_stage else self.stages[-1].head.output.weight

    def _share_summed_grads(self) -> None:
        # Gradients left by an earlier step were summed by its finish_grads: count them once.
        if self.tp_group.size() > 1:
            tp.share_summed_grads(tp.sequence_parallel_params(self), self.tp_group.size())
            copies = tp.tp_replica_params(self)
            if copies:
                tp.share_summed_grads(copies, copies[0].tp_replicas)
        tied = self.tied_weight
        if tied is not None:
            tp.share_summed_grads([tied], self.embedding_group.size())

    def finish_grads(self) -> None:
        """Sums sequence-parallel partial gradients over TP, those of key/value heads copied onto
        several TP ranks over each head's copies, and tied-embedding gradients over the
        first and last stage (called by ``step``, which accumulates over several calls; after a
        custom backward call it yourself, once per optimizer step)."""
        if self.tp_group.size() > 1:
            tp.allreduce_sequence_parallel_grads(self, self.tp_group)
            tp.allreduce_tp_replica_grads(self, self.tp_group)
        tied = self.tied_weight
        if tied is not None:
            if tied.grad is None:
                tied.grad = torch.zeros_like(tied)
            dist.all_reduce(tied.grad, group=self.embedding_group)

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """All-gathers vocab-parallel logits over TP and drops the padding: [b, s, V]."""
        return ops.gather_from_tp_region(logits, self.tp_group, dim=-1)[..., : self.vocab_size]

    @torch.no_grad()
    def hf_state_dict(self, grads: bool = False) -> Dict[str, torch.Tensor]:
        """This rank's parameters (or their gradients) as the original model's full tensors,
        keyed by its state-dict names. Collective over the TP group.

        Args:
            grads: return gradients (zeros where none) instead of values.
        """
        out = {}
        for export in self.exports:
            local = export.param.grad if grads else export.param
            local = torch.zeros_like(export.param) if local is None else local.contiguous()
            shards = [torch.empty_like(local) for _ in range(self.tp_group.size())]
            dist.all_gather(shards, local, group=self.tp_group)
            out[export.hf_name] = export.unshard(shards)
        return out


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


def _tie(exports: List[Export], output: nn.Module, table: nn.Parameter) -> None:
    """Makes ``output`` use ``table`` as its weight (one tensor, one gradient)."""
    for export in exports:
        if export.param is output.weight:
            export.param = table
    output.weight = table


def parallelize(
    model: nn.Module,
    tp: Optional[int] = None,
    pp: Optional[int] = None,
    schedule: str = "1f1b",
    n_microbatches: Optional[int] = None,
    sequence_parallel: bool = False,
    recompute: Optional[str] = None,
    split: Optional[Union[Sequence[int], str]] = None,
    state: Optional[ParallelState] = None,
    grad_scaler=None,
) -> ParallelCausalLM:
    """Shards a transformers causal LM over tensor- and pipeline-parallel ranks.

    Projections become Column/RowParallelLinear (heads split per TP rank), the token
    embedding a VocabParallelEmbedding and the head a vocab-parallel output layer whose loss
    never gathers the logits (the vocabulary is padded to a multiple of tp when needed). The
    decoder layers are cut into pipeline stages: embedding on the first, final norm + head on
    the last. Tied embeddings share one tensor on one rank and are kept in sync across ranks.
    ``model`` itself is not modified.

    Args:
        model: LlamaForCausalLM, MistralForCausalLM, MixtralForCausalLM, Qwen2ForCausalLM,
            Qwen3ForCausalLM, GemmaForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM, Phi3ForCausalLM or
            GPT2LMHeadModel, identical on every rank; or built on the meta device, whose shards
            ``load_hf_weights`` then fills from a checkpoint.
        tp: tensor-parallel size (default: the parallel state's).
        pp: pipeline-parallel size (default: the parallel state's).
        schedule: pipeline schedule name (torchpp.schedule.SCHEDULES) when pp > 1; zero-bubble
            schedules split each linear's backward into B and W. DualPipe runs two pipelines
            in opposite directions: rank r holds model stages r and p-1-r (the model twice
            over the ranks), ``step`` sums each stage's gradients over its two ranks, the
            gradient norm counts them once, and both end ranks hold the batch loss.
        n_microbatches: microbatches per step (default: pp).
        sequence_parallel: keep norms/dropout on sequence slices (Megatron-3).
        recompute: None, "full" (checkpoint each block) or "selective" (attention core only).
        split: first decoder-layer index of each model stage after the first; default even;
            "auto": a quick profile and torchpp.plan's partitioner choose it (models/auto_split.py).
        state: the ParallelState (default: the current one, or init_parallel(tp, pp)).
        grad_scaler: fp16 loss scaling (torchpp.parallel.GradScaler): ``step`` scales every
            backward by its current scale; give it to DistributedOptimizer too, which unscales,
            skips steps with an inf or NaN on any rank, and updates it.

    Returns:
        A ParallelCausalLM holding this rank's stages.
    """
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in FAMILIES:
        raise NotImplementedError(f"torchpp.parallelize: model type {model_type!r} ({type(model).__name__}) is not "
                                  f"supported; supported: {sorted(FAMILIES)}")
    check_recompute_mode(recompute)
    state = _resolve_state(state, tp, pp)
    _ensure_tp_rng(state)
    n_microbatches = n_microbatches or state.pp
    num_stages, mine, rank_of, num_pipelines = _placement(schedule, state.pp, n_microbatches, state.pp_rank)
    ctx = ConversionContext(state.tp_group, sequence_parallel, recompute, split_bw=state.pp > 1)
    family = FAMILIES[model_type](model, ctx)
    if isinstance(split, str) and split == "auto":
        if any(param.is_meta for param in model.parameters()):
            raise ValueError("torchpp.parallelize: split='auto' times the model's layers, which a meta-device model "
                             "cannot run; give split=[...] or build the model with weights")
        from torchpp.models.auto_split import auto_split

        split = auto_split(model, num_stages, state.pp, rank_of)
    bounds = layer_bounds(family.num_layers, num_stages, split)
    rotary = family.rotary()
    built: Dict[int, CausalLMStage] = {}
    for index in mine:
        built[index] = CausalLMStage(
            family.embedding() if index == 0 else None,
            [family.block(i) for i in range(bounds[index], bounds[index + 1])],
            family.head() if index == num_stages - 1 else None,
            rotary, sequence_parallel, ctx.tp_size, recompute,
        )
    first, last = 0, num_stages - 1
    embedding_group = loss_group = None
    if family.tied:
        if rank_of[first] == rank_of[last] or num_pipelines == 2:  # DualPipe: both ends hold both
            if first in built:  # one copy: the head reads the embedding's table
                _tie(ctx.exports, built[last].head.output, built[first].embedding.tokens.weight)
        else:
            embedding_group = _end_ranks_group(state, rank_of[first], rank_of[last])
            if last in built:  # after finish_grads both copies hold the same gradient: count it once
                built[last].head.output.weight.shared_duplicate = True
    if num_pipelines == 2:
        loss_group = _end_ranks_group(state, rank_of[first], rank_of[last])
    stages = [built[i] for i in mine]
    wrapped = ParallelCausalLM(stages, mine, state, ctx, family.vocab_size, embedding_group, loss_group)
    wrapped.weights_pending = materialize_meta(wrapped, state.device)  # filled by load_hf_weights
    wrapped.to(state.device)
    wrapped.hf_config = model.config
    if family.tied:
        wrapped.tied_names = dict(getattr(model, "_tied_weights_keys", None) or {})
    wrapped.grad_scaler = grad_scaler
    if state.pp > 1:
        from torchpp.pipeline import PipelineStage, build_schedule

        pipeline_stages = [
            PipelineStage(built[i], i, num_stages, state.device, group=state.pp_group, tp_group=state.tp_group)
            for i in mine
        ]
        # Sequence-parallel outputs differ per TP rank, so the pipeline must not split/gather them.
        wrapped.schedule = build_schedule(schedule, pipeline_stages, n_microbatches, loss_fn=wrapped._microbatch_loss,
                                          scatter_gather=not sequence_parallel, grad_scaler=grad_scaler)
    return wrapped
