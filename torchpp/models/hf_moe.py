"""Mixtral's sparse mixture-of-experts block with each expert's MLP split over tensor parallelism.

Megatron's expert tensor parallelism with ETP = TP: every rank routes every token (the router
is replicated), runs its slice of the intermediate size of each expert a token picked, and the
partial outputs are summed over TP as a row-parallel layer's are. The router's gradient is a
partial sum on each rank (its probabilities weight partial expert outputs), so it is flagged to
be summed over TP with the sequence-parallel norms.
"""
from __future__ import annotations

import copy
import re
from typing import Callable, Dict, Optional

import torch
import torch.nn.functional as F
from torch import nn

from torchpp import ops
from torchpp import tensor_parallel as tp
from torchpp.models import hf_convert as C
from torchpp.tensor_parallel.utils import mark_tensor_parallel


class ParallelSparseMoE(nn.Module):
    """Args:
        router: the HF top-k router (copied; returns logits, top-k weights, top-k indices).
        gate_up_proj: [experts, 2 * intermediate / t, hidden], this rank's [gate_r; up_r] of each expert.
        down_proj: [experts, hidden, intermediate / t].
        act: the activation between gate and up.
        group: the TP group.
        sequence_parallel: the input is this rank's sequence slice (gathered first; the output
            reduce-scattered back).
    """

    def __init__(self, router: nn.Module, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, act: Callable,
                 group, sequence_parallel: bool = False):
        super().__init__()
        self.router = tp.mark_sequence_parallel(router)
        self.gate_up_proj = nn.Parameter(gate_up_proj)
        self.down_proj = nn.Parameter(down_proj)
        tp_size = group.size()
        mark_tensor_parallel(self.gate_up_proj, partition_dim=1, group_size=tp_size)
        mark_tensor_parallel(self.down_proj, partition_dim=2, group_size=tp_size)
        self.act, self.group, self.sequence_parallel = act, group, sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            x = ops.gather_from_sp_region(x, self.group, dim=1)
        else:
            x = ops.copy_to_tp_region(x, self.group)
        batch, seq_len, hidden = x.shape
        tokens = x.reshape(-1, hidden)
        _, weights, chosen = self.router(tokens)
        partial = torch.zeros_like(tokens)
        num_experts = self.gate_up_proj.shape[0]
        with torch.no_grad():  # which tokens (and their top-k slot) each expert serves
            hits = F.one_hot(chosen, num_classes=num_experts).permute(2, 1, 0)
        for expert in hits.sum(dim=(1, 2)).nonzero().flatten().tolist():
            slot, token = torch.where(hits[expert])
            gate, up = F.linear(tokens[token], self.gate_up_proj[expert]).chunk(2, dim=-1)
            out = F.linear(self.act(gate) * up, self.down_proj[expert]) * weights[token, slot, None]
            partial.index_add_(0, token, out.to(partial.dtype))
        partial = partial.view(batch, seq_len, hidden)
        if self.sequence_parallel:
            return ops.reduce_scatter_to_sp_region(partial, self.group, dim=1)
        return ops.reduce_from_tp_region(partial, self.group)

    def extra_repr(self) -> str:
        experts, rows, _ = self.gate_up_proj.shape
        return f"experts={experts}, intermediate={rows // 2} per rank, sequence_parallel={self.sequence_parallel}"


def sparse_moe(ctx, block: nn.Module, intermediate_size: int, hf_prefix: str) -> ParallelSparseMoE:
    """This rank's share of an HF MixtralSparseMoeBlock (router ``gate``, ``experts`` holding 3-D
    ``gate_up_proj`` and ``down_proj``), exported under ``hf_prefix``."""
    t, rank = ctx.tp_size, ctx.tp_group.rank()
    if intermediate_size % t:
        raise ValueError(f"torchpp.parallelize: tp={t} must divide the experts' intermediate_size={intermediate_size}")
    experts = block.experts
    fused = C.UngroupFused([intermediate_size] * 2, t, dim=1)  # each expert's [gate; up] rows, regrouped
    columns = C.Concatenated(2)  # each expert's down_proj columns
    gate_up_shape = (experts.gate_up_proj.shape[0], 2 * intermediate_size // t, experts.gate_up_proj.shape[2])
    down_shape = (*experts.down_proj.shape[:2], intermediate_size // t)
    moe = ParallelSparseMoE(
        copy.deepcopy(block.gate),
        fused.shard(experts.gate_up_proj.detach(), rank, t, gate_up_shape).clone(),
        columns.shard(experts.down_proj.detach(), rank, t, down_shape).clone(),
        experts.act_fn, ctx.tp_group, ctx.sequence_parallel,
    )
    C.export_module(ctx.exports, moe.router, f"{hf_prefix}.gate")
    ctx.exports.append(C.Export(f"{hf_prefix}.experts.gate_up_proj", moe.gate_up_proj, fused))
    ctx.exports.append(C.Export(f"{hf_prefix}.experts.down_proj", moe.down_proj, columns))
    return moe


class MixtralExpertsOnDisk:
    """transformers keeps Mixtral's experts fused in memory (``mlp.experts.gate_up_proj`` [E, 2I,
    H], ``mlp.experts.down_proj`` [E, H, I], router ``mlp.gate``) but writes and reads them one
    expert at a time: ``block_sparse_moe.experts.{e}.w1`` (gate), ``w3`` (up), ``w2`` (down) and
    ``block_sparse_moe.gate``. This maps between the two for load_hf_weights and
    save_hf_checkpoint, so their folders are the ones transformers and other tools exchange."""

    _FUSED = re.compile(r"^(.*layers\.\d+)\.mlp\.(gate\.weight|experts\.gate_up_proj|experts\.down_proj)$")

    def __init__(self, num_experts: int):
        self.num_experts = num_experts

    def read(self, name: str, reader) -> Optional[torch.Tensor]:
        """The in-memory tensor ``name`` assembled from the per-expert ones, or None when
        ``name`` is not an expert tensor."""
        match = self._FUSED.match(name)
        if match is None:
            return None
        base, what = f"{match.group(1)}.block_sparse_moe", match.group(2)
        if what == "gate.weight":
            return reader[f"{base}.gate.weight"]
        experts = range(self.num_experts)
        if what == "experts.gate_up_proj":
            return torch.stack([torch.cat([reader[f"{base}.experts.{e}.w1.weight"],
                                           reader[f"{base}.experts.{e}.w3.weight"]]) for e in experts])
        return torch.stack([reader[f"{base}.experts.{e}.w2.weight"] for e in experts])

    def write(self, name: str, tensor: torch.Tensor) -> Dict[str, torch.Tensor]:
        """The on-disk tensors for the in-memory ``name``."""
        match = self._FUSED.match(name)
        if match is None:
            return {name: tensor}
        base, what = f"{match.group(1)}.block_sparse_moe", match.group(2)
        if what == "gate.weight":
            return {f"{base}.gate.weight": tensor}
        if what == "experts.gate_up_proj":
            out = {}
            for e, fused in enumerate(tensor):
                gate, up = fused.chunk(2)
                out[f"{base}.experts.{e}.w1.weight"], out[f"{base}.experts.{e}.w3.weight"] = gate, up
            return out
        return {f"{base}.experts.{e}.w2.weight": down for e, down in enumerate(tensor)}


def on_disk_format(config) -> Optional[MixtralExpertsOnDisk]:
    """How a model type's tensors are named on disk when not as in memory, or None."""
    if getattr(config, "model_type", None) == "mixtral":
        return MixtralExpertsOnDisk(config.num_local_experts)
    return None
