"""Checks that a parallelized model equals the unwrapped one: loss, logits, every gradient and
one SGD step, in float64 (or the ``dtype=`` given: float32 for the GPU checks). Run on every
rank of an initialised process group (tests, the model sweep); the unwrapped reference runs in
this process on the group's device. Each raises AssertionError naming what differs and by how
much.
"""
from __future__ import annotations

import copy
from typing import Dict, Optional, Union

import torch
from torch import nn

import torchpp
from torchpp.models import parallelize
from torchpp.testing.tiny_models import RANDOM_IN_TRAINING, tiny_model
from torchpp.tensor_parallel.random import rng_restored

import contextlib
import functools

RTOL, ATOL = 1e-9, 1e-10
BATCH, SEQ = 4, 16
LR = 0.1


@contextlib.contextmanager
def float64_throughout():
    """Keeps float64 tensors float64 where a model casts to float32 on purpose (norms computed in
    float32, routers' softmax, transformers' loss): with those casts every ordering of the work
    (microbatches, shards) rounds differently at float32's 1e-7, and a float64 comparison
    would measure that instead of the parallelization. Both models run under it."""
    def keeps(dtype) -> bool:
        return dtype in (torch.float32, torch.float)

    original_float, original_to, original_type = torch.Tensor.float, torch.Tensor.to, torch.Tensor.type

    # A cast to float32 becomes one to float64 (float32 parameters a model keeps, e.g. a
    # router's, are cast up where the model casts them).
    def float_(self, *args, **kwargs):
        return original_to(self, torch.float64) if self.is_floating_point() else original_float(self, *args, **kwargs)

    def to(self, *args, **kwargs):
        if self.is_floating_point():
            dtype = kwargs.get("dtype", next((a for a in args if isinstance(a, torch.dtype)), None))
            if keeps(dtype):
                args = tuple(torch.float64 if isinstance(a, torch.dtype) else a for a in args)
                kwargs = {**kwargs, "dtype": torch.float64} if "dtype" in kwargs else kwargs
        return original_to(self, *args, **kwargs)

    def type_(self, dtype=None, *args, **kwargs):
        if self.is_floating_point() and (keeps(dtype) or dtype in ("torch.FloatTensor", "torch.float32")):
            return original_to(self, torch.float64)
        return original_type(self, dtype, *args, **kwargs) if dtype is not None else original_type(self)

    def with_dtype(function, of_float64_only=False):
        @functools.wraps(function)
        def wrapped(input, *args, **kwargs):
            if keeps(kwargs.get("dtype")) and (not of_float64_only or input.dtype == torch.float64):
                kwargs["dtype"] = torch.float64
            return function(input, *args, **kwargs)
        return wrapped

    # softmax with dtype=float32 as a function, a torch function or a tensor method (a router's).
    homes = [(home, name) for home in (torch.nn.functional, torch, torch.Tensor) for name in ("softmax", "log_softmax")]
    # A float32 buffer shaped like a float64 tensor (Inkling's experts accumulate in one).
    likes = [(torch, name) for name in ("zeros_like", "empty_like", "ones_like", "full_like")]
    saved = {(home, name): getattr(home, name) for home, name in homes + likes}
    torch.Tensor.float, torch.Tensor.to, torch.Tensor.type = float_, to, type_
    for (home, name), function in saved.items():
        setattr(home, name, with_dtype(function, of_float64_only=(home, name) in likes))
    try:
        yield
    finally:
        torch.Tensor.float, torch.Tensor.to, torch.Tensor.type = original_float, original_to, original_type
        for (home, name), function in saved.items():
            setattr(home, name, function)


# atol of float32 tensors, relative to their scale: a float64 model's few float32 tensors (a
# router's weight) are computed alike in both runs; a float32 model (the GPU checks) sums
# microbatches, shards and kernels in other orders, which round at ~1e-7 of their terms.
_FLOAT32_ATOL = {"of a float64 model": 1e-7, "of a float32 model": 1e-6}
_float32_atol = _FLOAT32_ATOL["of a float64 model"]


@contextlib.contextmanager
def precision(dtype: torch.dtype):
    """The context a check runs in: float64 throughout for float64 models (see above); other
    dtypes as the model casts them, float32 tensors compared at a float32 model's tolerance."""
    global _float32_atol
    if dtype == torch.float64:
        with float64_throughout():
            yield
        return
    _float32_atol = _FLOAT32_ATOL["of a float32 model"]
    try:
        yield
    finally:
        _float32_atol = _FLOAT32_ATOL["of a float64 model"]


def exact_causal_lm_loss(logits, labels, vocab_size=None, num_items_in_batch=None, ignore_index=-100,
                         shift_labels=None, **kwargs):
    """transformers' ForCausalLMLoss in the logits' own dtype (it computes in float32, which
    would cap a float64 comparison at float32's precision)."""
    targets = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:] if shift_labels is None \
        else shift_labels
    logits = logits[..., : vocab_size or logits.size(-1)]
    reduction = "mean" if num_items_in_batch is None else "sum"
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1),
                                             ignore_index=ignore_index, reduction=reduction)
    return loss if num_items_in_batch is None else loss / num_items_in_batch


def batch(vocab: int, seed: int = 7, batch_size: int = BATCH, seq_len: int = SEQ):
    """Random ids and their labels (one ignored), the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch_size, seq_len), generator=g)
    labels = ids.clone()
    labels[0, 2] = -100
    return ids, labels


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Equal to float64 precision (rtol 1e-9); a tensor in float32 (a router's weight and its
    gradient, or a float32 model's) to float32's (rtol 1e-5; atol 1e-7 of the tensor's scale, 1e-6
    under ``precision(torch.float32)``: see _FLOAT32_ATOL); bfloat16 and float16 to their short
    mantissas' (rtol 2e-2, atol 2e-2 of the scale)."""
    if actual.shape != expected.shape:
        raise AssertionError(f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}")
    dtypes = (actual.dtype, expected.dtype)
    if torch.bfloat16 in dtypes or torch.float16 in dtypes:
        rtol, atol = 2e-2, 2e-2
    elif torch.float32 in dtypes:
        rtol, atol = 1e-5, _float32_atol
    else:
        rtol, atol = RTOL, ATOL
    actual, expected = actual.detach().double(), expected.detach().double()
    # atol scales with the tensor, so entries that cancel to ~0 are judged against its magnitude.
    atol = atol * max(1.0, expected.abs().max().item()) if expected.numel() else atol
    if not torch.allclose(actual, expected, rtol=rtol, atol=atol):
        worst = (actual - expected).abs().max().item()
        raise AssertionError(f"{what}: max abs difference {worst:.3e} (scale {expected.abs().max().item():.3e})")


class _Probe(nn.Module):
    """A fixed projection of a base model's hidden states to a scalar loss (models without a head)."""

    def __init__(self, hidden: int, device=None):
        super().__init__()
        g = torch.Generator().manual_seed(11)
        self.register_buffer("direction", torch.randn(hidden, generator=g, dtype=torch.float64).to(device))

    def forward(self, hidden: torch.Tensor, target=None) -> torch.Tensor:
        return (hidden.double() * self.direction).sum(-1).pow(2).mean()


def _hidden_states(out) -> torch.Tensor:
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]


def _is_causal_lm(model: nn.Module) -> bool:
    return model.get_output_embeddings() is not None


def _reference(model: nn.Module, ids, labels):
    """(loss, logits or hidden states, {name: grad}) of the unwrapped model."""
    if _is_causal_lm(model):
        model.loss_function = exact_causal_lm_loss
        out = model(input_ids=ids, labels=labels, use_cache=False)
        loss, output = out.loss, out.logits
    else:
        out = model(input_ids=ids, use_cache=False)
        output = _hidden_states(out)
        loss = _Probe(output.size(-1), output.device)(output)
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters(remove_duplicate=False) if p.grad is not None}
    return loss.detach(), output.detach(), grads


def _sgd(params) -> None:
    with torch.no_grad():
        for p in params:
            if p.grad is not None:
                p.add_(p.grad, alpha=-LR)


def _compare_grads(wrapped, reference_grads: Dict[str, torch.Tensor], what: str) -> int:
    grads = wrapped.full_state_dict(grads=True)
    compared = 0
    for name, grad in grads.items():
        expected = reference_grads.get(name)
        if expected is None:
            if grad.abs().max() > 0:
                raise AssertionError(f"{what}: {name} has a gradient the unwrapped model's parameter lacks")
            continue
        assert_close(grad, expected, f"{what} grad of {name}")
        compared += 1
    if not compared:
        raise AssertionError(f"{what}: no gradient compared")
    return compared


def _compare_values(wrapped, reference: nn.Module, what: str) -> None:
    values = wrapped.full_state_dict()
    expected = dict(reference.named_parameters(remove_duplicate=False))
    for name, value in values.items():
        assert_close(value, expected[name], f"{what} value of {name} after one SGD step")


def check_tp(model_type: str, tp: int = 2, *, sequence_parallel: bool = False, plan=None,
             compiled: Union[bool, str] = False, **extra) -> str:
    """tp ranks (pp=1): the wrapped model called as before returns the same loss and full
    logits; its gradients and one SGD step equal the unwrapped model's. ``plan``: parallelize's;
    ``compiled``: as check_cp's."""
    with precision(extra.get("dtype", torch.float64)):
        return _check_tp(model_type, tp, sequence_parallel, plan, compiled, **extra)


def _check_tp(model_type: str, tp: int, sequence_parallel: bool, plan, compiled, **extra) -> str:
    state = torchpp.init_parallel(tp=tp, pp=1)
    model = tiny_model(model_type, **extra)
    reference = copy.deepcopy(model).to(state.device)
    ids, labels = (t.to(state.device) for t in batch(model.config.get_text_config().vocab_size))
    # The wrapped model draws what the reference drew (PhiMoE's router samples experts in training).
    with rng_restored(state.device):
        ref_loss, ref_output, ref_grads = _reference(reference, ids, labels)
    _sgd(reference.parameters())
    wrapped = parallelize(model, state=state, sequence_parallel=sequence_parallel, plan=plan)
    if compiled:
        torch._dynamo.reset()
        _compile(wrapped, per_layer=compiled == "layers")
    what = f"{model_type} tp={tp}{' sp' if sequence_parallel else ''}" + (f" compiled {compiled}" if compiled else "")
    if _is_causal_lm(model):
        wrapped.loss_function = exact_causal_lm_loss
        out = wrapped(input_ids=ids, labels=labels, use_cache=False)
        loss, output = out.loss, out.logits
    else:
        out = wrapped(input_ids=ids, use_cache=False)
        output = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        loss = _Probe(output.size(-1), output.device)(output)
    assert_close(loss, ref_loss, f"{what} loss")
    assert_close(output, ref_output, f"{what} {'logits' if _is_causal_lm(model) else 'hidden states'}")
    loss.backward()
    if compiled == "layers":
        _check_no_graph_break(what)
    compared = _compare_grads(wrapped, ref_grads, what)
    _sgd(wrapped.parameters())
    _compare_values(wrapped, reference, what)
    sharded = sum(1 for p in wrapped.parameters() if getattr(p, "tensor_model_parallel", False))
    return f"loss {loss.item():.6f}, {compared} grads, {sharded} sharded" + (
        f"; {SPLIT_NOTE}{_split_linears(wrapped, reference)}" if plan == "auto" else "")


SPLIT_NOTE = "linears split per layer: "


def _split_linears(wrapped: nn.Module, reference: nn.Module) -> str:
    """Per layer class of the wrapped stack, how many linears hold a weight smaller than the unwrapped
    model's (plan="auto" may keep some whole)."""
    from torchpp.models.auto_plan import split_counts

    from torchpp.models.auto_experts import split_weight

    return split_counts(wrapped, wrapped.parallel_plan["pp"].layers, lambda name, linear: split_weight(linear).numel()
                        < split_weight(reference.get_submodule(name)).numel())


def check_pp(model_type: str, pp: int = 2, schedule: str = "zb-h1", n_microbatches: int = 4, tp: int = 1,
             plan=None, compiled: Optional[str] = None, **extra) -> str:
    """pp (x tp) ranks: ``step`` over the pipeline gives the unwrapped model's loss (on the last
    stage) and gradients, and one SGD step its values. ``plan``: parallelize's; ``compiled="layers"``:
    each decoder layer of this rank's stages compiled (as check_cp's; the pipeline calls no model
    forward for a whole-model compile to take)."""
    if compiled not in (None, "layers"):
        raise ValueError(f"check_pp: compiled must be None or 'layers', got {compiled!r}")
    with precision(extra.get("dtype", torch.float64)):
        return _check_pp(model_type, pp, schedule, n_microbatches, tp, plan, compiled, **extra)


def _check_pp(model_type: str, pp: int, schedule: str, n_microbatches: int, tp: int, plan, compiled, **extra) -> str:
    state = torchpp.init_parallel(tp=tp, pp=pp)
    model = tiny_model(model_type, **extra)
    if model_type in RANDOM_IN_TRAINING:  # a microbatch would draw other numbers than the whole batch
        model.eval()
    reference = copy.deepcopy(model).to(state.device)
    ids, labels = (t.to(state.device) for t in batch(model.config.get_text_config().vocab_size))
    ref_loss, _, ref_grads = _reference(reference, ids, labels)
    _sgd(reference.parameters())
    causal = _is_causal_lm(model)
    probe = None if causal else _Probe(model.config.get_text_config().hidden_size, state.device)
    wrapped = parallelize(model, schedule=schedule, n_microbatches=n_microbatches, state=state,
                          loss_fn=None if causal else probe, plan=plan)
    what = f"{model_type} pp={pp} tp={tp} {schedule}" + (" compiled layers" if compiled else "")
    if compiled:
        torch._dynamo.reset()
        _compile(wrapped, per_layer=True)
    if causal:
        loss = wrapped.step(ids if wrapped.has_first_stage else None, labels if wrapped.has_last_stage else None)
    else:
        loss = wrapped.step(ids if wrapped.has_first_stage else None, target=labels)
    if compiled:
        _check_no_graph_break(what)
    if wrapped.has_last_stage:
        assert_close(loss, ref_loss, f"{what} loss")
    compared = _compare_grads(wrapped, ref_grads, what)
    _sgd(wrapped.parameters())
    _compare_values(wrapped, reference, what)
    return f"{compared} grads on this rank" + (f", loss {loss.item():.6f}" if loss is not None else "")


def packed_positions(batch_size: int, seq_len: int) -> torch.Tensor:
    """Position ids of rows packing several sequences (restarting at 0), with boundaries inside
    and between context-parallel chunks; the same on every rank."""
    cuts_of_row = ([3, seq_len // 2 + 1, seq_len - 2], [seq_len // 4 + 1])
    rows = []
    for row in range(batch_size):
        positions = torch.arange(seq_len)
        for cut in cuts_of_row[row % 2]:
            positions[cut:] = torch.arange(seq_len - cut)
        rows.append(positions)
    return torch.stack(rows)


def decoder_layers(model: nn.Module) -> list:
    """A transformers model's layers (this rank's), found by its ``_no_split_modules`` class names."""
    layers = [m for m in model.modules() if type(m).__name__ in (model._no_split_modules or ())]
    if not layers:
        raise ValueError(f"no layers of {type(model).__name__}'s _no_split_modules")
    return layers


def _compile(wrapped: nn.Module, per_layer: bool) -> None:
    if not per_layer:
        wrapped.forward = torch.compile(wrapped.forward, backend="aot_eager")
        return
    for layer in decoder_layers(wrapped):
        # (not fullgraph: a break in a hook's own frame would pass it, falling back to eager there)
        layer.compile(backend="aot_eager")
    torch._dynamo.utils.counters.clear()


def _check_no_graph_break(what: str) -> None:
    """After a forward with each layer compiled: none of them broke its graph, hooks included (a
    frame dynamo gave up on, run eagerly, is counted as unimplemented, not as a break)."""
    counters = torch._dynamo.utils.counters
    breaks = {**counters["graph_break"], **counters["unimplemented"]}
    if breaks:
        raise AssertionError(f"{what}: a compiled layer broke its graph: {breaks}")


def check_cp(model_type: str, cp: int = 2, *, tp: int = 1, pp: int = 1, dp: int = 1, ep: int = 1, schedule: str = "zb-h1",
             n_microbatches: int = 2, packed: bool = False, mode: str = "ring", layout: str = "zigzag",
             seq_len: int = SEQ, recompute: Optional[str] = None, sequence_parallel: bool = False, zero: int = 0,
             plan=None, config: Optional[dict] = None, all_to_all_size: Optional[int] = None,
             compiled: Union[bool, str] = False, **extra) -> str:
    """cp (x tp x pp x dp) ranks, each cp group given its data-parallel replica's rows of the
    batch: the context-parallel model's loss (and, at pp=1, its logits, gathered over cp) equal
    the unwrapped model's on those rows, and after one SGD step through DistributedOptimizer
    (gradients summed over cp, averaged over dp) so do its gradients and values (the unwrapped
    model's from the mean of the replicas' losses). ``plan``: parallelize's; ``ep``: experts split
    over ep of the dp x cp ranks; ``config``: the tiny model's config values whose names this
    function takes itself (xLSTM's ``mode``), besides ``extra``'s; ``all_to_all_size``: mode
    all-to-all+ring's (parallelize's ``cp_all_to_all_size``); ``compiled``: the wrapped model's forward
    torch.compile'd (aot_eager: autograd traced ahead, no inductor build; at pp=1), or with
    ``"layers"`` each decoder layer compiled, as torchtitan compiles blocks, none breaking its graph."""
    with precision(extra.get("dtype", torch.float64)):
        return _check_cp(model_type, cp, tp, pp, dp, ep, schedule, n_microbatches, packed, mode, layout, seq_len,
                         recompute, sequence_parallel, zero, plan, config or {}, all_to_all_size, compiled, **extra)


def _cp_reference_forward(reference: nn.Module, probe: Optional[nn.Module], ids, labels, positions):
    """(loss or None, logits, output type) of a causal LM; (probe loss, hidden states, output type) of a base model."""
    if probe is None:
        out = reference(input_ids=ids, labels=labels, use_cache=False, position_ids=positions)
        return getattr(out, "loss", None), getattr(out, "logits", None), type(out).__name__
    out = reference(input_ids=ids, use_cache=False, position_ids=positions)
    hidden = _hidden_states(out)
    return probe(hidden), hidden, type(out).__name__


def _check_cp(model_type, cp, tp, pp, dp, ep, schedule, n_microbatches, packed, mode, layout, seq_len, recompute,
              sequence_parallel, zero, plan, config, all_to_all_size, compiled, **extra) -> str:
    from torchpp.context_parallel import unshard_sequence
    from torchpp.parallel import DistributedOptimizer

    if compiled is True and pp > 1:
        raise ValueError(f"check_cp: compiled=True compiles the model's forward, which pp={pp} does not call")

    state = torchpp.init_parallel(tp=tp, pp=pp, cp=cp, dp=dp, ep=ep)
    model = tiny_model(model_type, **extra, **config)
    if model_type in RANDOM_IN_TRAINING:  # a microbatch would draw other numbers than the whole batch
        model.eval()
    reference = copy.deepcopy(model).to(state.device)
    ids, labels = (t.to(state.device) for t in batch(model.config.get_text_config().vocab_size, seq_len=seq_len))
    positions = packed_positions(ids.size(0), seq_len).to(state.device) if packed else None
    reference.loss_function = exact_causal_lm_loss
    causal = _is_causal_lm(model)
    if not causal and pp > 1:
        raise NotImplementedError(f"check_cp compares a base model ({model_type}) at pp=1 only, got pp={pp}")
    probe = None if causal else _Probe(model.config.get_text_config().hidden_size, state.device)
    replicas = [slice(d * ids.size(0) // dp, (d + 1) * ids.size(0) // dp) for d in range(dp)]
    # (loss, logits) of each replica's rows; a base model's: the probe of its hidden states, and those
    outs = [_cp_reference_forward(reference, probe, ids[rows], labels[rows],
                                  None if positions is None else positions[rows]) for rows in replicas]
    if outs[0][0] is None:
        raise NotImplementedError(f"check_cp compares causal LMs' losses: {model_type}'s forward returns no loss "
                                  f"({outs[0][2]})")
    (sum(loss for loss, _, _ in outs) / dp).backward()
    mine = replicas[state.dp_rank]
    ids, labels = ids[mine], labels[mine]
    positions = None if positions is None else positions[mine]
    ref_loss, ref_logits = outs[state.dp_rank][0].detach(), outs[state.dp_rank][1].detach()
    ref_grads = {name: p.grad for name, p in reference.named_parameters(remove_duplicate=False) if p.grad is not None}
    _sgd(reference.parameters())
    wrapped = parallelize(model, schedule=schedule, n_microbatches=n_microbatches, state=state, cp_mode=mode,
                          cp_layout=layout, recompute=recompute, sequence_parallel=sequence_parallel, plan=plan,
                          cp_all_to_all_size=all_to_all_size)
    wrapped.loss_function = exact_causal_lm_loss
    if compiled:
        torch._dynamo.reset()
        _compile(wrapped, per_layer=compiled == "layers")
    # ZeRO-3 gathers before each module's forward: it takes the model itself.
    optimizer = DistributedOptimizer(wrapped if zero == 3 else wrapped.named_parameters(), torch.optim.SGD, state,
                                     lr=LR, accumulations_per_step=n_microbatches if zero >= 2 else 0, zero=zero)
    mode_name = mode if all_to_all_size is None else f"{mode} (all-to-all groups of {all_to_all_size})"
    what = f"{model_type} cp={cp} tp={tp} pp={pp} dp={dp} ep={ep}{' ' + schedule if pp > 1 else ''} {mode_name} {layout}" + \
        (" packed" if packed else "") + (f" compiled{' layers' if compiled == 'layers' else ''}" if compiled else "")
    if pp == 1 and probe is not None:  # every rank takes the probe of the whole sequence's hidden states
        out = wrapped(input_ids=ids, position_ids=positions, use_cache=False)
        hidden = unshard_sequence(_hidden_states(out), state.cp_group, dim=1, layout=layout)
        loss = probe(hidden)  # (the gather's backward keeps this rank's tokens' part: summed over cp, the whole)
        assert_close(hidden, ref_logits, f"{what} hidden states")
        loss.backward()
    elif pp == 1:
        out = wrapped(input_ids=ids, labels=labels, position_ids=positions, use_cache=False)
        loss = out.loss
        assert_close(unshard_sequence(out.logits, state.cp_group, dim=1, layout=layout), ref_logits, f"{what} logits")
        loss.backward()
        if compiled == "layers":
            _check_no_graph_break(what)
    else:
        loss = wrapped.step(ids, labels=labels, position_ids=positions)
        if compiled == "layers":
            _check_no_graph_break(what)
    if loss is not None:
        assert_close(loss, ref_loss, f"{what} loss")
    optimizer.step()
    compared = 0
    if zero < 2:  # ZeRO-2/3 free the full gradients once reduce-scattered
        compared = _compare_grads(wrapped, ref_grads, what)
    if zero == 3:
        optimizer.gather_params()
    _compare_values(wrapped, reference, what)
    return f"{compared} grads on this rank" + (f", loss {loss.item():.6f}" if loss is not None else "")
