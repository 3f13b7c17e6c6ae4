"""Unsharded reference blocks and helpers to compare a TP model against them."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

TOLERANCES = {torch.float64: dict(rtol=1e-10, atol=1e-12), torch.float32: dict(rtol=1e-5, atol=1e-6)}


def assert_close(actual, expected, what):
    tol = TOLERANCES[expected.dtype]
    # atol scales with the tensor so entries that cancel to ~0 are judged against its magnitude.
    atol = tol["atol"] * max(1.0, expected.abs().max().item())
    torch.testing.assert_close(actual, expected, rtol=tol["rtol"], atol=atol, msg=lambda m: f"{what}: {m}")


def tp_subgroup(tp_size):
    """Splits the world into consecutive TP groups of tp_size; returns this rank's group."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mine = None
    for start in range(0, world, tp_size):
        group = dist.new_group(list(range(start, start + tp_size)))
        if start <= rank < start + tp_size:
            mine = group
    return mine


class MLP(nn.Module):
    def __init__(self, hidden, dtype):
        super().__init__()
        self.norm = nn.LayerNorm(hidden, dtype=dtype)
        self.fc1 = nn.Linear(hidden, 4 * hidden, dtype=dtype)
        self.fc2 = nn.Linear(4 * hidden, hidden, dtype=dtype)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(self.norm(x))))


class Attention(nn.Module):
    """Causal multi-head self-attention on [s, b, h] inputs."""

    def __init__(self, hidden, heads, dtype):
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(hidden, dtype=dtype)
        self.q = nn.Linear(hidden, hidden, dtype=dtype)
        self.k = nn.Linear(hidden, hidden, dtype=dtype)
        self.v = nn.Linear(hidden, hidden, dtype=dtype)
        self.o = nn.Linear(hidden, hidden, dtype=dtype)

    def forward(self, x):
        return self.o(attention_core(self.q, self.k, self.v, self.norm(x), self.heads))


def attention_core(q_proj, k_proj, v_proj, x, heads):
    """Projects x to q/k/v with `heads` heads (all heads or this rank's), returns [s, b, heads*d]."""

    def split_heads(t):  # [s, b, heads*d] -> [b, heads, s, d]; s is the full sequence even under SP
        return t.reshape(t.shape[0], t.shape[1], heads, -1).permute(1, 2, 0, 3)

    out = F.scaled_dot_product_attention(split_heads(q_proj(x)), split_heads(k_proj(x)), split_heads(v_proj(x)), is_causal=True)
    return out.permute(2, 0, 1, 3).flatten(2)


def singleton_group():
    """A group of this rank alone (every rank creates every such group, in the same order):
    what a one-process reference model's layers are built over."""
    return dist.new_subgroups(group_size=1)[0]


def train_reference(model, tokens, labels, group, steps, lr, max_norm, skip_steps=()):
    """One-process AdamW training on the full batch with torch's own clipping (no update in
    ``skip_steps``); returns the per-step losses and the optimizer (GPT-style models whose
    loss is gpt_loss)."""
    from torchpp.models.gpt import gpt_loss

    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        optimizer.zero_grad()
        loss = gpt_loss(model(tokens), labels, group)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        if step not in skip_steps:
            optimizer.step()
        losses.append(loss.detach())
    return torch.stack(losses), optimizer
