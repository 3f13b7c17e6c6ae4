"""A transformers causal LM under ``parallelize``: its own forward (pp=1, context-parallel
batches sharded on the way in) plus ``step`` / ``eval_step`` over the pipeline, and the
causal-LM loss on vocabulary-parallel logits."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from torchpp import tensor_parallel as tp
from torchpp.models.autograd_walk import walk_back
from torchpp.models.parallel_model import ParallelMixin, sharded_call_inputs
from torchpp.models.plans import text_config
from torchpp.models.traced_forward import model_device, trace_tokens, traced_forward

IGNORE_INDEX = -100


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


def model_shifts_labels(model) -> bool:
    """Whether the model's own loss is transformers' causal one (token t predicts label t+1),
    or compares each token's logits with its own label, as the causal-LM heads of some
    encoder-decoder families do (Blenderbot's): one forward on a few random tokens tells. The
    pipeline's loss follows the model's.

    Raises:
        PlanError: the model's loss reads more than its logits (ProphetNet's adds its n-gram
            streams' predictions): the pipeline's loss, computed from the logits alone, would differ.
    """
    device = model_device(model)
    if device.type == "meta":  # nothing to run: transformers' convention
        return True
    generator = torch.Generator().manual_seed(0)
    vocab = getattr(text_config(model), "vocab_size", None) or 2
    ids, labels = torch.randint(0, vocab, (2, 1, trace_tokens(model)), generator=generator).to(device)
    try:  # with autograd: the walk below
        out = traced_forward(model, ids, labels=labels)
    except Exception:  # noqa: BLE001 - a model that cannot run here: transformers' convention
        return True
    if getattr(out, "loss", None) is None or getattr(out, "logits", None) is None:
        return True
    _check_loss_reads_logits(model, out)
    logits = out.logits.detach().double()  # all of them, as the model's loss takes them
    loss = out.loss.detach().double()
    per_token = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
    shifted = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
    close = lambda a, b: bool(torch.isclose(a, b, rtol=1e-4, atol=1e-6))  # noqa: E731 - losses in float32
    return not (close(loss, per_token) and not close(loss, shifted))


def _check_loss_reads_logits(model, out) -> None:
    """Raises PlanError where the model's loss reaches a parameter other than through its logits
    (or its MoE load-balancing loss, which the pipeline adds itself): a walk back through autograd,
    exact whatever the dtype."""
    from torchpp.tensor_parallel.styles import PlanError

    ends = [t.grad_fn for t in (out.logits, getattr(out, "aux_loss", None))
            if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    reached = walk_back([out.loss], blocked=ends).params
    if reached:
        names = [name for name, p in model.named_parameters() if id(p) in reached]
        raise PlanError(f"torchpp.parallelize: {type(model).__name__}'s own loss reads more than its logits "
                        f"(it reaches {names[:3]} other than through out.logits, e.g. predictions it does not "
                        f"return as logits): a pipeline's last stage computes the loss from the logits alone and "
                        f"would train on another loss; use pp=1")


class ParallelCausalLM(ParallelMixin):
    """A transformers causal LM under ``parallelize``: its own forward (pp=1) plus ``step``."""

    vocab_parallel_logits = False
    context_parallel = None  # torchpp.context_parallel.hf.ContextParallel when cp > 1
    # Under a pipeline with output_router_logits: the stages carry the router statistics and
    # ``aux_loss`` holds the last step's load-balancing loss (last-stage ranks, else None).
    carries_router_load = False
    aux_loss: Optional[torch.Tensor] = None
    loss_shifts_labels = True  # False: the model's loss compares each token with its own label

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """All-gathers vocab-parallel logits (``vocab_parallel_logits=True``) over TP, padding dropped."""
        from torchpp import ops

        vocab = self._logits_width()
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
        from torchpp.context_parallel.hf import shard_batch

        batch = sharded_call_inputs(args, kwargs, ("input_ids", "inputs_embeds", "labels", "shift_labels",
                                                   "position_ids", "attention_mask"))
        if not self.loss_shifts_labels and batch["labels"] is not None:
            return self._per_token_loss_call(cp, batch, kwargs)
        out = super().__call__(**shard_batch(cp, **batch), **kwargs)
        if getattr(out, "loss", None) is not None:
            out.loss = cp.sum_over_ranks(out.loss)
        return out

    def _per_token_loss_call(self, cp, batch, kwargs):
        """A model whose own loss compares each token with its own label and takes the mean inline
        (BART's causal-LM heads): its shard's mean would weigh the ranks' tokens unequally, so the
        loss is computed here, its convention kept: this rank's labels summed over the batch's."""
        from torchpp.context_parallel.hf import shard_batch

        labels = batch.pop("labels")
        out = super().__call__(**shard_batch(cp, **batch), **kwargs)
        total = causal_lm_loss(out.logits, cp.shard(labels), self._lm_group(), self._logits_width(),
                               reduction="sum", shifted=True)
        out.loss = cp.sum_over_ranks(total / (labels != IGNORE_INDEX).sum().clamp(min=1))
        return out

    def _logits_width(self) -> int:
        """How many logits the model's head computes, all of which transformers' loss takes (a head
        wider than config.vocab_size included: Inkling 2's unpadded_vocab_size); a column-split
        head's slices are padded beyond it where tp does not divide it."""
        head = self.get_output_embeddings()
        tp_conf = getattr(head, "tp", None)
        if tp_conf is not None and getattr(tp_conf, "out_features", None):
            return tp_conf.out_features
        # nn.Linear's out_features, transformers' Conv1D's nf; else the config's vocabulary.
        return getattr(head, "out_features", None) or getattr(head, "nf", None) or text_config(self).vocab_size

    def _lm_group(self) -> Optional[dist.ProcessGroup]:
        head = self.get_output_embeddings()
        tp_conf = getattr(head, "tp", None)
        return self.tp_group if tp_conf is not None and tp_conf.column else None

    def _vocab_parallel_loss(self, logits, labels, vocab_size=None, num_items_in_batch=None, ignore_index=IGNORE_INDEX,
                             shift_labels=None, **kwargs):
        """transformers' ForCausalLMLoss on vocab-parallel logits (``vocab_parallel_logits=True``)."""
        if shift_labels is not None:
            labels = torch.nn.functional.pad(shift_labels, (1, 0), value=ignore_index)
        vocab = self._logits_width()  # the model may pass logits.size(-1): this rank's slice
        if num_items_in_batch is None:
            return causal_lm_loss(logits, labels, self._lm_group(), vocab)
        return causal_lm_loss(logits, labels, self._lm_group(), vocab, reduction="sum") / num_items_in_batch

    def _microbatch_loss(self, output, labels: torch.Tensor) -> torch.Tensor:
        # The schedule weights a microbatch by its share of rows; dividing that back out and
        # summing over the batch's labelled tokens makes the total exactly the batch mean,
        # even when microbatches hold different numbers of ignored labels.
        logits, load = (output[0], output[1:]) if isinstance(output, tuple) else (output, ())
        total = causal_lm_loss(logits, labels, self._lm_group(), self._logits_width(), reduction="sum",
                               shifted=self.context_parallel is not None or not self.loss_shifts_labels)
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
            targets = shift_labels(labels) if self.loss_shifts_labels else labels
            self._batch_tokens = int((targets != IGNORE_INDEX).sum().clamp(min=1))
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
        from torchpp.context_parallel.positions import check_given

        if position_ids is not None:  # on every rank given them, not stage 0's alone (which would leave the rest waiting)
            check_given(cp.model_positions, position_ids)
        if self.has_first_stage:
            batch = shard_batch(cp, input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask)
            input_ids, position_ids = batch["input_ids"], batch["position_ids"]
        if self.has_last_stage and labels is not None:
            labels = cp.shard(shift_labels(labels) if self.loss_shifts_labels else labels)
        return input_ids, labels, position_ids, None


