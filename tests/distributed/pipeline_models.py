"""A small transformer LM for pipeline tests (embedding, attention/MLP blocks of split-B/W
linears, LayerNorm, head) and its single-process reference run."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from torchpp.pipeline import SplitBWLinear

VOCAB, HIDDEN, HEADS, SEQ = 32, 16, 2, 6


def linear(in_features: int, out_features: int, split: bool) -> nn.Module:
    return SplitBWLinear(in_features, out_features) if split else nn.Linear(in_features, out_features)


class Attention(nn.Module):
    def __init__(self, split: bool):
        super().__init__()
        self.qkv = linear(HIDDEN, 3 * HIDDEN, split)
        self.proj = linear(HIDDEN, HIDDEN, split)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, HEADS, h // HEADS).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / math.sqrt(h // HEADS)
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        attn = scores.masked_fill(mask, float("-inf")).softmax(-1) @ v
        return self.proj(attn.transpose(1, 2).reshape(b, s, h))


class Block(nn.Module):
    def __init__(self, split: bool = True):
        super().__init__()
        self.ln1 = nn.LayerNorm(HIDDEN)
        self.attn = Attention(split)
        self.ln2 = nn.LayerNorm(HIDDEN)
        self.fc1 = linear(HIDDEN, 2 * HIDDEN, split)
        self.fc2 = linear(2 * HIDDEN, HIDDEN, split)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyLM(nn.Module):
    """Children run in registration order, so split_model can cut it by name."""

    def __init__(self, num_layers: int, split: bool = True):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(Block(split) for _ in range(num_layers))
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = linear(HIDDEN, VOCAB, split)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def lm_loss(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


def make_model(num_layers: int, dtype, seed: int = 0, split: bool = True) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(num_layers, split).to(dtype)


def make_batches(batch: int, steps: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randint(0, VOCAB, (batch, SEQ), generator=g), torch.randint(0, VOCAB, (batch, SEQ), generator=g))
        for _ in range(steps)
    ]


def stage_split_points(num_stages: int, num_layers: int):
    """Stage k starts at layer k*L/num_stages: embedding with layer 0, norm/head with the last."""
    per = num_layers // num_stages
    return [f"layers.{k * per}" for k in range(1, num_stages)]
