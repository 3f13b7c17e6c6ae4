"""MiniMax's lightning attention over a sharded sequence: the layer's own block loop, corrected by
the states entering this rank's chunks.

Lightning attention is linear attention with one decay per head: S_t = lam S_{t-1} + k_t^T v_t,
o_t = q_t S_t (lam = exp(-slope)), before the output norm and gate. The layer runs unchanged on
this rank's shard, as if its pieces were one sequence from a zero state; since o_t is linear in the
state a piece starts from, adding lam^i q_t (S_true - S_run) to the i-th token of each piece (S_run:
the state the layer's run carried into the piece, S_true: the state the sequence's earlier chunks
leave) gives the whole sequence's output. Each piece's state from zero, sum_j lam^(n-j) k_j^T v_j,
is all-gathered and composed (``chunk_states.diagonal_states``: the decay is a scalar). q, k and v
are taken from the layer's projection (a hook), the correction is added where the output norm
reads the attention output (a pre-hook).
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
from torch import nn

from torchpp.context_parallel.chunk_states import active, diagonal_states, pieces_of, track_layers

if TYPE_CHECKING:
    from torchpp.context_parallel.hf import ContextParallel

QKV = "_torchpp_cp_qkv"


def is_lightning_attention(module: nn.Module) -> bool:
    return type(module).__name__.endswith("LightningAttention") and \
        all(hasattr(module, attr) for attr in ("qkv_proj", "act_fn", "norm", "slope_rate", "head_dim"))


def _keep_projection(layer: nn.Module, projection: nn.Module, args, output) -> None:
    if active.get() is not None:
        setattr(layer, QKV, output)


def _add_carried(layer: nn.Module, norm: nn.Module, args):
    cp = active.get()
    if cp is None:
        return None
    attention = args[0]  # [b, s, heads * head_dim], heads-major, as the layer's block loop left it
    batch, seq, _ = attention.shape
    heads, dim = layer.num_attention_heads, layer.head_dim
    qkv = layer.act_fn(layer.__dict__.pop(QKV)).reshape(batch, seq, heads, 3 * dim)
    query, key, value = (t.transpose(1, 2) for t in torch.split(qkv, dim, dim=3))  # [b, heads, s, dim]
    n = seq // pieces_of(cp)
    slope = layer.slope_rate.to(query.dtype)  # [heads, 1, 1]
    steps = torch.arange(1, n + 1, dtype=query.dtype, device=query.device)[:, None]
    query_decay, key_decay = torch.exp(-slope * steps), torch.exp(-slope * (n - steps))  # lam^i, lam^(n-i)
    piece_decay = torch.exp(-slope * n)
    pieces = [slice(start, start + n) for start in range(0, seq, n)]
    finals = [(key[:, :, rows] * key_decay).transpose(-1, -2) @ value[:, :, rows] for rows in pieces]
    entering = diagonal_states(cp, [piece_decay.expand_as(final) for final in finals], finals)
    carried, run_state = [], torch.zeros_like(finals[0])
    for rows, final, state in zip(pieces, finals, entering):
        carried.append((query[:, :, rows] * query_decay) @ (state - run_state))
        run_state = piece_decay * run_state + final  # what the layer's own run carries into the next piece
    correction = torch.cat(carried, dim=2).transpose(1, 2).reshape(batch, seq, heads * dim)
    return (attention + correction.to(attention.dtype),) + tuple(args[1:])


def _prepare(layer: nn.Module) -> None:
    layer.qkv_proj.register_forward_hook(functools.partial(_keep_projection, layer))
    layer.norm.register_forward_pre_hook(functools.partial(_add_carried, layer))


def apply_lightning(model: nn.Module, cp: "ContextParallel") -> int:
    """Shards each lightning attention layer of ``model`` over ``cp``; returns how many."""
    return track_layers(model, cp, is_lightning_attention, _prepare)
