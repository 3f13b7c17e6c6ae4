"""xLSTM's mLSTM over a sharded sequence (``xLSTMBackend``): each chunk's recurrence continued from
the state the earlier chunks leave.

Per head the mLSTM keeps a matrix memory C [d_k, d_v] and a normalizer n [d_k], each decayed by
sigmoid(f_t) and added exp(i_t) k_t v_t^T and exp(i_t) k_t, stored as transformers stores them:
(c, n, m) with real values c * exp(m) (m the running max that keeps exponentials finite). Over a
chunk the map is diagonal in the decay, S_end = exp(F) S_start + S_end(empty), F the chunk's summed
log forget gates; the output q C / max(|q n|, 1) is not affine in the state. So each chunk runs the
model's own backend twice: from the empty state (m = -inf, so its max leaves out the start) for its
last state, the chunks' states all-gathered and composed in sequence order (``chunk_states``), then
from the state entering it for its outputs. The running max composed so equals the whole
sequence's, so the backend's epsilon weighs the same.
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING, List

import torch
import torch.nn.functional as F
from torch import nn

from torchpp.context_parallel.chunk_states import entering_states, pieces_of

if TYPE_CHECKING:
    from torchpp.context_parallel.hf import ContextParallel

EMPTY = -1e38  # (a max for a state that holds nothing: exp(EMPTY - m) is 0)


def is_mlstm_backend(module: nn.Module) -> bool:
    """transformers' xLSTM backend: its chunkwise, sequence and step kernels."""
    return type(module).__name__ == "xLSTMBackend" and all(
        hasattr(module, name) for name in ("chunkwise_kernel_fn", "sequence_kernel_fn", "step_kernel_fn"))


def defines_mlstm(modeling) -> bool:
    return hasattr(modeling, "xLSTMBackend")


def _split(state: torch.Tensor, d_k: int, d_v: int):
    return state[..., :d_k * d_v], state[..., d_k * d_v:d_k * d_v + d_k], state[..., d_k * d_v + d_k:d_k * d_v + d_k + 1]


def _sharded_forward(backend: nn.Module, cp: "ContextParallel", forward, query, key, value, igate, fgate,
                     c_initial=None, n_initial=None, m_initial=None, return_last_states=None, mode=None):
    if c_initial is not None or n_initial is not None or m_initial is not None:
        raise NotImplementedError("torchpp context parallelism: an mLSTM given a state (a cache): sharded layers keep "
                                  "no state (use_cache=False)")
    mode = backend.config.mode if mode is None else mode
    if mode == "train_with_padding":
        raise NotImplementedError("torchpp context parallelism: xLSTM's mode 'train_with_padding' pads its input and "
                                  "returns no last state, which a chunk of the sequence must hand on; use mode 'train' "
                                  "or 'inference'")
    returns_states = "inference" in mode or bool(
        backend.config.return_last_states if return_last_states is None else return_last_states)
    n_pieces = pieces_of(cp)
    length = query.size(2) // n_pieces
    if "train" in mode and length % backend.config.chunk_size:
        raise ValueError(f"torchpp context parallelism: xLSTM's training kernel runs chunks of "
                         f"{backend.config.chunk_size} tokens, but each of this rank's {n_pieces} pieces of the "
                         f"sequence holds {length}: use a sequence length divisible by "
                         f"{backend.config.chunk_size * n_pieces * cp.size}")
    cp.calls.made()  # the layer mixes its sequence through sharded code
    batch, heads, _, d_k = key.shape
    d_v = value.size(-1)
    pieces = [tuple(t.narrow(2, start, length) for t in (query, key, value, igate, fgate))
              for start in range(0, query.size(2), length)]
    maps: List[torch.Tensor] = []
    for q, k, v, i, f in pieces:
        empty = (k.new_zeros(batch, heads, d_k, d_v, dtype=torch.float32), k.new_zeros(batch, heads, d_k,
                 dtype=torch.float32), k.new_full((batch, heads, 1), EMPTY, dtype=torch.float32))
        _, (c, n, m) = forward(q, k, v, i, f, *empty, return_last_states=True, mode=mode)
        decay = F.logsigmoid(f).sum(-1, keepdim=True).to(m.dtype)
        maps.append(torch.cat([c.flatten(2), n, m, decay], dim=-1))

    def then(step, state):
        (c, n, m), (step_c, step_n, step_m), decay = _split(state, d_k, d_v), _split(step, d_k, d_v), step[..., -1:]
        top = torch.maximum(m + decay, step_m)
        before, own = torch.exp(m + decay - top), torch.exp(step_m - top)
        return torch.cat([before * c + own * step_c, before * n + own * step_n, top], dim=-1)

    states = entering_states(cp, maps, then, lambda zeros: zeros[..., :-1])  # (0, 0, 0): the model's own start
    outs = []
    for (q, k, v, i, f), state in zip(pieces, states):
        c, n, m = _split(state, d_k, d_v)
        out, _ = forward(q, k, v, i, f, c.reshape(batch, heads, d_k, d_v), n, m, return_last_states=True, mode=mode)
        outs.append(out)
    h = torch.cat(outs, dim=2)
    return (h, None) if returns_states else h


def apply_mlstm(model: nn.Module, cp: "ContextParallel") -> int:
    """Shards each xLSTM backend of ``model`` over ``cp``; returns how many."""
    done = 0
    for module in model.modules():
        if is_mlstm_backend(module) and not getattr(module, "_torchpp_mlstm", False):  # (recompute applies cp again)
            module.forward = functools.partial(_sharded_forward, module, cp, module.forward)
            module._torchpp_mlstm = True
            done += 1
    return done
