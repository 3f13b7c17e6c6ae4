"""Checks that an expert-parallel model equals the unwrapped one on the whole batch, in float64:
each data-parallel rank (the ep ranks among them) runs its own slice of the batch, and the mean
loss, the load-balancing (aux) loss, the gradients after DistributedOptimizer's reduction and
one SGD step equal the unwrapped model's on the whole batch."""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist

import torchpp
from torchpp.models import parallelize
from torchpp.parallel import DistributedOptimizer
from torchpp.testing.model_checks import (LR, _compare_grads, _compare_values, _sgd, assert_close,
                                          exact_causal_lm_loss, float64_throughout, precision)
from torchpp.testing.tiny_models import tiny_model

BATCH, SEQ = 4, 16
AUX_COEF = 0.5  # large enough that a wrong aux-loss gradient shows in the comparison


def full_batch(vocab: int, seed: int = 7, rows: int = BATCH):
    """Random ids and labels (none ignored, so every rank's slice holds as many labels)."""
    ids = torch.randint(0, vocab, (rows, SEQ), generator=torch.Generator().manual_seed(seed))
    return ids, ids.clone()


def check_ep(model_type: str, ep: int = 2, tp: int = 1, **extra) -> str:
    """ep (x tp) ranks, dp = world / tp data-parallel ranks each with its own batch slice."""
    with precision(extra.get("dtype", torch.float64)):
        return _check_ep(model_type, ep, tp, **extra)


def _clip_reference(model, max_norm):
    """The unwrapped model's global gradient norm, its gradients clipped as torch clips them."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm = torch.sqrt(sum(g.pow(2).sum() for g in grads))
    if max_norm is not None:
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(scale)
    return norm


def route_everything_to(model, experts) -> None:
    """Makes every router of ``model`` send every token to ``experts`` (its top-k indices
    replaced; the weights stay the router's), e.g. all to the first rank's experts."""
    for module in model.modules():
        if type(module).__name__.endswith("Router") and hasattr(module, "top_k"):
            def hook(module, args, output):
                logits, weights, index = output
                return logits, weights, torch.tensor(experts, device=index.device).expand_as(index).contiguous()
            module.register_forward_hook(hook)


def _check_ep(model_type: str, ep: int, tp: int, expert_tensor_parallel: bool = False, zero: bool = False,
              max_norm=None, route_to=None, plan=None, **extra) -> str:
    state = torchpp.init_parallel(tp=tp, ep=ep)
    model = tiny_model(model_type, output_router_logits=True, router_aux_loss_coef=AUX_COEF, **extra)
    reference = copy.deepcopy(model).to(state.device)
    if route_to is not None:
        route_everything_to(model, route_to)
        route_everything_to(reference, route_to)
    ids, labels = (t.to(state.device) for t in full_batch(model.config.vocab_size))
    reference.loss_function = exact_causal_lm_loss
    ref = reference(input_ids=ids, labels=labels, use_cache=False)
    ref.loss.backward()
    ref_norm = _clip_reference(reference, max_norm)
    ref_grads = {name: p.grad for name, p in reference.named_parameters(remove_duplicate=False) if p.grad is not None}
    _sgd(reference.parameters())

    wrapped = parallelize(model, state=state, ep=ep, expert_tensor_parallel=expert_tensor_parallel, plan=plan)
    wrapped.loss_function = exact_causal_lm_loss
    optimizer = DistributedOptimizer(wrapped.named_parameters(), torch.optim.SGD, state, lr=LR, zero=zero,
                                     max_norm=max_norm)
    optimizer.zero_grad()
    rows = BATCH // state.dp
    mine = slice(state.dp_rank * rows, (state.dp_rank + 1) * rows)
    out = wrapped(input_ids=ids[mine], labels=labels[mine], use_cache=False)
    what = f"{model_type} ep={ep} tp={tp}{' etp' if expert_tensor_parallel else ''}"
    has_aux = getattr(ref, "aux_loss", None) is not None  # DeepSeek-V3's causal LM has none
    if has_aux:
        assert_close(out.aux_loss, ref.aux_loss, f"{what} aux loss")  # every rank: the whole batch's
    out.loss.backward()
    mean_loss = out.loss.detach().clone()
    dist.all_reduce(mean_loss, group=state.dp_group)
    assert_close(mean_loss / state.dp, ref.loss, f"{what} loss (mean over dp ranks)")
    norm = optimizer.step()
    assert_close(norm, ref_norm, f"{what} global gradient norm")  # each expert counted once
    if not zero:  # ZeRO-1 leaves each rank its shard of the reduced gradients
        compared = _compare_grads(wrapped, ref_grads, what)
    else:
        compared = 0
    _compare_values(wrapped, reference, what)
    experts = [p for p in wrapped.parameters() if getattr(p, "expert_parallel", None)]
    assert bool(experts) == (ep > 1), f"{what}: {len(experts)} expert-parallel parameters"
    local = {tuple(p.shape) for p in experts}
    aux = f"aux {out.aux_loss.item():.6f}" if has_aux else "no aux loss"
    return f"loss {mean_loss.item() / state.dp:.6f}, {aux}, {compared} grads, experts {local}"


def check_ep_pp(model_type: str, ep: int = 2, pp: int = 2, schedule: str = "zb-h1", n_microbatches: int = 2,
                **extra) -> str:
    """ep x pp ranks: ``step`` over the pipeline on each data-parallel rank's batch slice; the
    loss (mean over dp, on the last stage), the reduced gradients and one SGD step equal the
    unwrapped model's on the whole batch (without the aux loss, which is per microbatch under a
    pipeline: ``check_pp_aux_loss``)."""
    with float64_throughout():
        return _check_ep_pp(model_type, ep, pp, schedule, n_microbatches, **extra)


def _check_ep_pp(model_type: str, ep: int, pp: int, schedule: str, n_microbatches: int, **extra) -> str:
    state = torchpp.init_parallel(pp=pp, ep=ep)
    model = tiny_model(model_type, **extra)
    reference = copy.deepcopy(model)
    batch = state.dp * n_microbatches  # a row per microbatch on each data-parallel rank
    ids, labels = full_batch(model.config.vocab_size, rows=batch)
    reference.loss_function = exact_causal_lm_loss
    ref = reference(input_ids=ids, labels=labels, use_cache=False)
    ref.loss.backward()
    ref_grads = {name: p.grad for name, p in reference.named_parameters(remove_duplicate=False) if p.grad is not None}
    _sgd(reference.parameters())

    wrapped = parallelize(model, state=state, ep=ep, schedule=schedule, n_microbatches=n_microbatches)
    optimizer = DistributedOptimizer(wrapped.named_parameters(), torch.optim.SGD, state, lr=LR,
                                     accumulations_per_step=n_microbatches)
    optimizer.zero_grad()
    mine = slice(state.dp_rank * n_microbatches, (state.dp_rank + 1) * n_microbatches)
    loss = wrapped.step(ids[mine] if wrapped.has_first_stage else None,
                        labels[mine] if wrapped.has_last_stage else None)
    what = f"{model_type} ep={ep} pp={pp} {schedule}"
    if wrapped.has_last_stage:
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss, group=state.dp_group)
        assert_close(mean_loss / state.dp, ref.loss, f"{what} loss (mean over dp ranks)")
    optimizer.step()
    compared = _compare_grads(wrapped, ref_grads, what)
    _compare_values(wrapped, reference, what)
    return f"{compared} grads on this rank"


def check_pp_aux_loss(model_type: str, ep: int = 2, pp: int = 2, schedule: str = "zb-h1", n_microbatches: int = 2,
                      **options) -> str:
    """The load-balancing loss under a pipeline (output_router_logits=True): ``step`` on each
    data-parallel rank's slice equals the unwrapped model under gradient accumulation over the
    GLOBAL microbatches (microbatch m of every data-parallel rank, in dp order): the aux loss
    ``model.aux_loss`` (mean of the microbatches' aux losses), the loss (mean over dp), the reduced
    gradients and one SGD step. ``padded``: rows end in padding (an attention mask), which
    transformers' aux loss leaves out; ``tp``, ``recompute``: as parallelize's."""
    with float64_throughout():
        return _check_pp_aux_loss(model_type, ep, pp, schedule, n_microbatches, **options)


def _check_pp_aux_loss(model_type: str, ep: int, pp: int, schedule: str, n_microbatches: int, recompute=None,
                       tp: int = 1, padded: bool = False, **extra) -> str:
    state = torchpp.init_parallel(pp=pp, ep=ep, tp=tp)
    model = tiny_model(model_type, output_router_logits=True, router_aux_loss_coef=AUX_COEF, **extra)
    reference = copy.deepcopy(model)
    m_count, dp = n_microbatches, state.dp
    ids, labels = full_batch(model.config.vocab_size, rows=dp * m_count)  # a row per microbatch and dp rank
    mask = None
    if padded:  # right padding: row r's last r % 4 tokens (the aux loss leaves them out, as transformers)
        mask = torch.ones_like(ids)
        for r in range(ids.size(0)):
            mask[r, SEQ - r % 4:] = 0
    reference.loss_function = exact_causal_lm_loss
    ref_losses, ref_aux = [], []
    for m in range(m_count):  # global microbatch m: row m of every data-parallel rank's slice
        rows = [d * m_count + m for d in range(dp)]
        out = reference(input_ids=ids[rows], labels=labels[rows], use_cache=False,
                        attention_mask=None if mask is None else mask[rows])
        (out.loss / m_count).backward()  # out.loss = LM loss + coef * aux_m, as transformers adds it
        ref_losses.append(out.loss.detach())
        ref_aux.append(out.aux_loss.detach())
    ref_grads = {name: p.grad for name, p in reference.named_parameters(remove_duplicate=False) if p.grad is not None}
    _sgd(reference.parameters())

    wrapped = parallelize(model, state=state, ep=ep, schedule=schedule, n_microbatches=n_microbatches,
                          recompute=recompute)
    optimizer = DistributedOptimizer(wrapped.named_parameters(), torch.optim.SGD, state, lr=LR,
                                     accumulations_per_step=n_microbatches)
    optimizer.zero_grad()
    mine = slice(state.dp_rank * m_count, (state.dp_rank + 1) * m_count)
    loss = wrapped.step(ids[mine] if wrapped.has_first_stage else None,
                        labels[mine] if wrapped.has_last_stage else None,
                        attention_mask=mask[mine] if mask is not None and wrapped.has_first_stage else None)
    what = f"{model_type} ep={ep} pp={pp} tp={tp} {schedule}{' padded' if padded else ''}{' recompute=' + recompute if recompute else ''} aux loss"
    aux = "no last stage"
    if wrapped.has_last_stage:
        expected_aux = torch.stack(ref_aux).mean()
        assert_close(wrapped.aux_loss, expected_aux, f"{what}: model.aux_loss")  # float32, as transformers'
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss, group=state.dp_group)
        # The aux part is a float32 quantity (transformers computes it so), summed here in
        # another order than the unwrapped model's: float32's precision on it, float64's on the rest.
        expected = torch.stack(ref_losses).mean()
        if not torch.allclose(mean_loss / dp, expected, rtol=1e-7, atol=0):
            raise AssertionError(f"{what}: loss {mean_loss.item() / dp!r} != {expected.item()!r}")
        aux = f"aux {wrapped.aux_loss.item():.6f}"
    else:
        assert wrapped.aux_loss is None, wrapped.aux_loss
    optimizer.step()
    compared = _compare_grads(wrapped, ref_grads, what)
    _compare_values(wrapped, reference, what)
    overlap = "on" if wrapped.schedule.overlap_forward_backward else "off"
    return f"{aux}, {compared} grads on this rank, overlap {overlap}"
