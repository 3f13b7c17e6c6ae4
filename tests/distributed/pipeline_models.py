"""A small transformer LM for pipeline tests (embedding, attention/MLP blocks of split-B/W
linears, LayerNorm, head) and its single-process reference run."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from torchpp.pipeline import SplitBWLinear
from torchpp.tensor_parallel import ColumnParallelLinear, RowParallelLinear

VOCAB, HIDDEN, HEADS, SEQ = 32, 16, 2, 6


def linear(in_features: int, out_features: int, split: bool) -> nn.Module:
    return SplitBWLinear(in_features, out_features) if split else nn.Linear(in_features, out_features)


def column(in_features, out_features, split, tp_group):
    """Output-sharded over tp_group when given (same initial values as the plain layer)."""
    if tp_group is None:
        return linear(in_features, out_features, split)
    return ColumnParallelLinear(in_features, out_features, split_bw=split, group=tp_group)


def row(in_features, out_features, split, tp_group):
    """Input-sharded over tp_group when given (same initial values as the plain layer)."""
    if tp_group is None:
        return linear(in_features, out_features, split)
    return RowParallelLinear(in_features, out_features, input_is_parallel=True, split_bw=split, group=tp_group)


class Attention(nn.Module):
    """qkv features are head-major (head, q/k/v, dim), so a column split is a split by heads."""

    def __init__(self, split: bool, tp_group=None):
        super().__init__()
        self.heads = HEADS // (tp_group.size() if tp_group is not None else 1)
        self.qkv = column(HIDDEN, 3 * HIDDEN, split, tp_group)
        self.proj = row(HIDDEN, HIDDEN, split, tp_group)

    def forward(self, x):
        b, s, _ = x.shape
        d = HIDDEN // HEADS
        q, k, v = self.qkv(x).view(b, s, self.heads, 3, d).permute(3, 0, 2, 1, 4)
        scores = q @ k.transpose(-1, -2) / math.sqrt(d)
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        attn = scores.masked_fill(mask, float("-inf")).softmax(-1) @ v
        return self.proj(attn.transpose(1, 2).reshape(b, s, self.heads * d))


class Block(nn.Module):
    def __init__(self, split: bool = True, tp_group=None):
        super().__init__()
        self.ln1 = nn.LayerNorm(HIDDEN)
        self.attn = Attention(split, tp_group)
        self.ln2 = nn.LayerNorm(HIDDEN)
        self.fc1 = column(HIDDEN, 2 * HIDDEN, split, tp_group)
        self.fc2 = row(2 * HIDDEN, HIDDEN, split, tp_group)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyLM(nn.Module):
    """Children run in registration order, so split_model can cut it by name."""

    def __init__(self, num_layers: int, split: bool = True, tp_group=None):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(Block(split, tp_group) for _ in range(num_layers))
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = linear(HIDDEN, VOCAB, split)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def lm_loss(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


def make_model(num_layers: int, dtype, seed: int = 0, split: bool = True, tp_group=None) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(num_layers, split, tp_group).to(dtype)


def make_batches(batch: int, seq_lens, seed: int = 1):
    """One (tokens, targets) pair per step; seq_lens gives each step's sequence length."""
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randint(0, VOCAB, (batch, s), generator=g), torch.randint(0, VOCAB, (batch, s), generator=g))
        for s in seq_lens
    ]


def stage_split_points(num_stages: int, num_layers: int):
    """Stage k starts at layer k*L/num_stages: embedding with layer 0, norm/head with the last."""
    per = num_layers // num_stages
    return [f"layers.{k * per}" for k in range(1, num_stages)]
