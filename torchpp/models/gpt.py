"""A Megatron-style GPT built from torchpp's tensor-parallel layers.

Activations are sequence-first, [s, b, h], as in Megatron, so sequence parallelism splits
dim 0. With tp=1 (a group of one rank) the model is an ordinary GPT, which is what tests
compare the parallel one against.
"""
from __future__ import annotations

import contextlib

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from torchpp import ops
from torchpp import tensor_parallel as tp


@dataclass
class GPTConfig:
    vocab_size: int = 256
    hidden_size: int = 64
    num_heads: int = 4
    num_layers: int = 2
    max_seq_len: int = 128
    ffn_multiplier: int = 4
    dropout: float = 0.0
    # Split B/W linears: zero-bubble schedules can then defer weight gradients to W passes.
    split_bw: bool = False


class ParallelAttention(nn.Module):
    """Causal self-attention: q/k/v split by heads (columns), the output projection by rows."""

    def __init__(self, config: GPTConfig, group, sequence_parallel: bool):
        super().__init__()
        tp_size = ops.group_of(group).size()
        self.heads_per_rank = tp.divide(config.num_heads, tp_size, "num_heads")
        self.dropout = config.dropout
        column = dict(group=group, sequence_parallel=sequence_parallel, split_bw=config.split_bw)
        self.q = tp.ColumnParallelLinear(config.hidden_size, config.hidden_size, **column)
        self.k = tp.ColumnParallelLinear(config.hidden_size, config.hidden_size, **column)
        self.v = tp.ColumnParallelLinear(config.hidden_size, config.hidden_size, **column)
        self.o = tp.RowParallelLinear(
            config.hidden_size, config.hidden_size, group=group, input_is_parallel=True,
            sequence_parallel=sequence_parallel, split_bw=config.split_bw,
        )

    def _heads(self, t: torch.Tensor) -> torch.Tensor:  # [s, b, n*d] -> [b, n, s, d]
        return t.reshape(t.shape[0], t.shape[1], self.heads_per_rank, -1).permute(1, 2, 0, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self._heads(self.q(x)), self._heads(self.k(x)), self._heads(self.v(x))
        dropout = self.dropout if self.training else 0.0
        # Heads are split over TP ranks, so attention dropout draws from the per-TP-rank stream.
        with tp.get_rng_tracker().fork() if dropout > 0 else contextlib.nullcontext():
            core = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        return self.o(core.permute(2, 0, 1, 3).flatten(2))


class ParallelMLP(nn.Module):
    """h -> ffn (columns) -> GeLU -> h (rows): one all-reduce (or RS/AG pair) each way."""

    def __init__(self, config: GPTConfig, group, sequence_parallel: bool):
        super().__init__()
        ffn = config.ffn_multiplier * config.hidden_size
        common = dict(group=group, sequence_parallel=sequence_parallel, split_bw=config.split_bw)
        self.fc1 = tp.ColumnParallelLinear(config.hidden_size, ffn, **common)
        self.fc2 = tp.RowParallelLinear(ffn, config.hidden_size, input_is_parallel=True, **common)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class GPTBlock(nn.Module):
    def __init__(self, config: GPTConfig, group, sequence_parallel: bool):
        super().__init__()
        self.ln1 = nn.LayerNorm(config.hidden_size)
        self.attention = ParallelAttention(config, group, sequence_parallel)
        self.ln2 = nn.LayerNorm(config.hidden_size)
        self.mlp = ParallelMLP(config, group, sequence_parallel)
        self.dropout = config.dropout
        if sequence_parallel:  # norms see a sequence slice: their gradients are partial per TP rank
            tp.mark_sequence_parallel(self.ln1)
            tp.mark_sequence_parallel(self.ln2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + F.dropout(self.attention(self.ln1(x)), self.dropout, self.training)
        return x + F.dropout(self.mlp(self.ln2(x)), self.dropout, self.training)


class GPTEmbedding(nn.Module):
    """Token (vocab-parallel) plus position embeddings; tokens [b, s] -> hidden [s(/t), b, h]."""

    def __init__(self, config: GPTConfig, group, sequence_parallel: bool):
        super().__init__()
        self.group = ops.group_of(group)
        self.sequence_parallel = sequence_parallel
        self.tokens = tp.VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, group=group, sequence_parallel=sequence_parallel, sequence_dim=0
        )
        self.positions = nn.Embedding(config.max_seq_len, config.hidden_size)
        if sequence_parallel:
            tp.mark_sequence_parallel(self.positions)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.tokens(input_ids.t())
        seq_len = input_ids.shape[1]
        positions = torch.arange(seq_len, device=input_ids.device)
        if self.sequence_parallel:  # this rank's slice of the sequence
            positions = positions.chunk(self.group.size())[torch.distributed.get_rank(self.group)]
        return hidden + self.positions(positions).unsqueeze(1)


class GPTHead(nn.Module):
    """Final norm and vocab-parallel output layer; returns logits [s, b, V/t]."""

    def __init__(self, config: GPTConfig, group, sequence_parallel: bool):
        super().__init__()
        self.norm = nn.LayerNorm(config.hidden_size)
        if sequence_parallel:
            tp.mark_sequence_parallel(self.norm)
        self.output = tp.ColumnParallelLinear(
            config.hidden_size, config.vocab_size, bias=False, group=group, sequence_parallel=sequence_parallel,
            split_bw=config.split_bw,
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.output(self.norm(hidden))


class GPT(nn.Sequential):
    """embedding, blocks..., head as one nn.Sequential, so pipeline splitting can cut between blocks.

    Args:
        config: model sizes.
        group: the TP ProcessGroup, its name, or None for the default group.
        sequence_parallel: run norms and dropout on sequence slices (Megatron-3).
    """

    def __init__(self, config: GPTConfig, group=None, sequence_parallel: bool = False):
        layers = [GPTEmbedding(config, group, sequence_parallel)]
        layers += [GPTBlock(config, group, sequence_parallel) for _ in range(config.num_layers)]
        layers.append(GPTHead(config, group, sequence_parallel))
        super().__init__(*layers)
        self.config = config
        self.group = ops.group_of(group)


def gpt_loss(logits: torch.Tensor, labels: torch.Tensor, group=None) -> torch.Tensor:
    """Mean token loss of vocab-parallel logits [s, b, V/t] against labels [b, s]."""
    return tp.vocab_parallel_cross_entropy(logits, labels.t(), group, reduction="mean")

