"""Rank-side checks of torchpp's Megatron drop-in (run on a pool of 4 gloo ranks, tp=2 x pp=2).

Each config builds this rank's GPTModel chunks with the one-process reference's weights, runs
Megatron's own schedule function and torchpp's drop-in on them, and reports relative errors
(losses; gradients gathered over TP) against both, plus where the TP linears' weight
gradients arrived (inside a W pass or not). The pytest side asserts.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.distributed as dist

import megatron_gpt as G
from megatron_cpu import megatron_on_cpu
from torchpp import _C

TP, PP, M = 2, 2, 4


def rel_err(value: torch.Tensor, reference: torch.Tensor) -> float:
    return float((value - reference).abs().max() / reference.abs().max().clamp(min=1e-300))


def _reference(batches) -> tuple:
    """The whole model in one process (tp = pp = 1 on every rank): weights, losses, gradients."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    G.init_megatron(1, 1)
    full, = G.build_chunks(G.make_config(1, 1))
    weights = {name: p.detach().clone() for name, p in full.named_parameters()}
    losses = G.run_schedule(get_forward_backward_func(), [full], batches, M)
    grads = {name: p.grad.detach().clone() for name, p in full.named_parameters()}
    return weights, losses, grads


def _full_grads(chunks) -> Dict[str, torch.Tensor]:
    """Every gradient of this rank's chunks (main_grad under Megatron's DDP), its TP shards
    gathered, by local parameter name."""
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    out = {}
    for index, chunk in enumerate(chunks):
        for name, param in chunk.named_parameters():
            grad = getattr(param, "main_grad", None)
            grad = (param.grad if grad is None else grad).detach()
            if getattr(param, "tensor_model_parallel", False):
                parts = [torch.empty_like(grad) for _ in range(group.size())]
                dist.all_gather(parts, grad.contiguous(), group=group)
                grad = torch.cat(parts, dim=param.partition_dim)
            out[f"{index}:{name}"] = grad.clone()
    return out


def _zero(chunks) -> None:
    for chunk in chunks:
        if hasattr(chunk, "zero_grad_buffer"):
            chunk.zero_grad_buffer()
        chunk.zero_grad(set_to_none=True)


def _wrap_ddp(chunks, config, overlap: bool):
    """Megatron's DDP around each chunk, with the hooks Megatron's training loop sets."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    ddp_config = DistributedDataParallelConfig(overlap_grad_reduce=overlap, bucket_size=2048)
    wrapped = [DistributedDataParallel(config, ddp_config, chunk) for chunk in chunks]
    config.no_sync_func = [c.no_sync for c in wrapped] if len(wrapped) > 1 else wrapped[0].no_sync
    config.finalize_model_grads_func = finalize_model_grads
    return wrapped


def _record_w(chunks) -> List[bool]:
    """Per weight-gradient delivery of a TP linear: whether it came from a W pass (an I pass
    that parked it reaches AccumulateGrad empty: not a delivery)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    seen: List[bool] = []

    def record(param):
        if _C.wgrad_in_deferred_accumulate() or _C.wgrad_parked_for(param) == 0:
            seen.append(bool(_C.wgrad_in_deferred_accumulate()))

    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear)) and module.weight is not None:
                module.weight.register_post_accumulate_grad_hook(record)
    return seen


def _record_inputs(chunks) -> List[str]:
    """The dtype of every activation a chunk received (Megatron's set_input_tensor)."""
    seen: List[str] = []
    for chunk in chunks:
        decoder = getattr(chunk, "module", chunk).decoder

        def record(module, args, decoder=decoder):
            if decoder.input_tensor is not None:
                seen.append(str(decoder.input_tensor.dtype))

        decoder.register_forward_pre_hook(record)
    return seen


LR = 0.1


def _optimizer(chunks):
    """torchpp's DistributedOptimizer over Megatron's groups (SGD: the update shows the gradient)."""
    from torchpp.models.megatron import parallel_state, summed_after_backward
    from torchpp.parallel import DistributedOptimizer

    params = [p for chunk in chunks for p in chunk.parameters()]
    optimizer = DistributedOptimizer(params, torch.optim.SGD, parallel_state(), max_norm=1e9,
                                     hold=summed_after_backward(chunks), lr=LR)
    optimizer.zero_grad()
    return optimizer


def _check_step(optimizer, chunks, weights, ref_grads) -> dict:
    """One optimizer step against the reference's: the global norm and every updated shard."""
    from megatron.core import parallel_state as ps

    tp_rank = ps.get_tensor_model_parallel_rank()
    before = {id(p): p.detach().clone() for chunk in chunks for p in chunk.parameters()}
    norm = optimizer.step()
    ref_norm = torch.sqrt(sum((g * g).sum() for g in ref_grads.values()))
    errors = {}
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            full = ref_grads[G.global_name(chunk, name, True)]
            expected = before[id(param)] - LR * G.shard_of(param, full, tp_rank, TP)
            errors[name] = rel_err(param.detach() - before[id(param)], expected - before[id(param)])
    return {"norm_vs_reference": rel_err(norm, ref_norm), "update_vs_reference": errors}


def run_config(spec: dict, reference) -> dict:
    """One config; see the module docstring."""
    from megatron.core.pipeline_parallel import get_forward_backward_func as megatron_get

    from torchpp.models.megatron import finalize_model_grads, get_forward_backward_func

    weights, ref_losses, ref_grads, batches = reference
    vp = 2 if spec["schedule"] == "interleaved-1f1b" else None
    G.init_megatron(TP, PP, vp)
    # gloo matches messages by order: Megatron's batched P2P at pp=2 (both neighbours are one
    # rank) can swap an activation and a gradient of one shape; its unbatched path cannot.
    config = G.make_config(TP, PP, vp, sp=spec.get("sp", False), finalize_model_grads_func=finalize_model_grads,
                           variable_seq_lengths=spec.get("variable", False), overlap_p2p_comm=vp is not None,
                           batch_p2p_comm=vp is None)
    chunks = G.build_chunks(config)
    G.load_reference(chunks, weights, tied=True)
    if spec.get("ddp"):
        chunks = _wrap_ddp(chunks, config, overlap=True)
    forward_only = spec.get("forward_only", False)
    meg_losses = G.run_schedule(megatron_get(), chunks, batches, M, forward_only=forward_only)
    meg_grads = None if forward_only else _full_grads(chunks)
    _zero(chunks)
    seen = _record_w(chunks)
    received = _record_inputs(chunks)
    optimizer = _optimizer(chunks) if spec.get("optimizer") else None
    func = get_forward_backward_func(spec["schedule"], split_bw=spec.get("split_bw", True))
    losses = G.run_schedule(func, chunks, batches, M, forward_only=forward_only)
    out = {"losses": losses, "w_deliveries": seen, "received_dtypes": sorted(set(received))}
    if optimizer is not None:
        out.update(_check_step(optimizer, chunks, weights, ref_grads))
    if losses:
        out["loss_vs_megatron"] = rel_err(torch.tensor(losses), torch.tensor(meg_losses))
        out["loss_vs_reference"] = rel_err(torch.tensor(losses), torch.tensor(ref_losses))
    if forward_only:
        out["grads_touched"] = [n for c in chunks for n, p in c.named_parameters() if p.grad is not None]
        return out
    grads = _full_grads(chunks)
    out["grad_vs_megatron"] = {name: rel_err(grads[name], meg_grads[name]) for name in grads}
    out["grad_vs_reference"] = {
        name: rel_err(grads[name], ref_grads[G.global_name(chunks[int(name[0])], name.split(":", 1)[1], True)])
        for name in grads}
    return out


def run_configs(specs: List[dict]) -> List[dict]:
    """Every config of ``specs`` on this rank, reusing one one-process reference per batch set."""
    results, references = [], {}
    with megatron_on_cpu():
        for spec in specs:
            lengths = tuple(spec.get("seq_lens", [G.SEQ] * M))
            if lengths not in references:
                batches = G.make_batches(M, seq_lens=list(lengths))
                references[lengths] = (*_reference(batches), batches)
            results.append(run_config(spec, references[lengths]))
    return results


def run_chunk_mismatch(case: str) -> str:
    """The drop-in called with a model list that does not fit the schedule; returns the error."""
    from megatron.core import parallel_state as ps

    from torchpp.models.megatron import get_forward_backward_func

    with megatron_on_cpu():
        G.init_megatron(TP, PP)
        chunks = G.build_chunks(G.make_config(TP, PP))
        if case == "zb-h1 with two chunks":
            name, model = "zb-h1", chunks * 2
        else:  # the first pipeline stage's ranks pass two chunks, the last stage's one
            name, model = "interleaved-1f1b", chunks * (2 if ps.get_pipeline_model_parallel_rank() == 0 else 1)
        try:
            G.run_schedule(get_forward_backward_func(name), model, G.make_batches(M), M)
        except ValueError as error:
            return str(error)
        return "no error"
