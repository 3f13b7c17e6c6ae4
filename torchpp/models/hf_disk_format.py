"""Tensors transformers names differently on disk than in memory (its checkpoint conversions).

transformers keeps some families' experts fused in memory but reads and writes them one
expert at a time; ``load_hf_weights`` and ``save_hf_checkpoint`` map between the two so their
folders are the ones transformers and other tools exchange.
"""
from __future__ import annotations

import re
from typing import Dict, Optional

import torch


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
