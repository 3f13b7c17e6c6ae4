"""A step's arguments on this rank: checked, split into microbatches, and each microbatch's
loss weight (its share of the batch, times the loss scale)."""
from __future__ import annotations

from typing import List

import torch
from torch.utils._pytree import tree_flatten

from torchpp.pipeline.microbatch import chunk_dim_of, loss_weights, split_args_kwargs_into_chunks, split_microbatches


class StepInputs:
    """Mixed into ``PipelineSchedule``: ``_prepare`` readies a step's microbatches for the executor."""

    def _prepare(self, kind: str, args, kwargs, target) -> bool:
        """Checks and splits this rank's step arguments; whether the input shapes changed since
        this executor's last step."""
        m = self.num_microbatches
        x = args[0] if args else None
        if kind == "train" and self._has_last and callable(self.loss_fn) and target is None:
            raise ValueError(f"torchpp pipeline: rank {self.rank} holds a last stage and needs target=")
        if self._has_first and x is None:
            raise ValueError(f"torchpp pipeline: rank {self.rank} holds a first stage and needs the batch input")
        if self._script is not None and (len(args) > 1 or kwargs):
            raise TypeError("torchpp pipeline: TorchScript stages take the batch tensor alone; got "
                            f"{len(args) - 1} more positional and {sorted(kwargs)} keyword arguments")
        if self._script is not None and self._has_last and self._loss_kwargs:
            raise TypeError(f"torchpp pipeline: a TorchScript loss_fn takes (output, target) alone; got loss_kwargs "
                            f"{sorted(self._loss_kwargs)}")
        # The common case, one batch tensor split along dim 0, skips the pytree walks (a step's
        # fixed cost delays the whole pipeline when it is on the first stage).
        plain = (len(args) == 1 and not kwargs and isinstance(x, torch.Tensor) and self.args_chunk_spec is None
                 and self.kwargs_chunk_spec is None)
        if not self._has_first:
            self._inputs = self._arguments = None
            firsts = []
        elif plain:
            self._inputs = firsts = split_microbatches(x, m)
            self._arguments = [((), {}) for _ in range(m)]
        else:
            args_split, kwargs_split = split_args_kwargs_into_chunks(args, kwargs, m, self.args_chunk_spec,
                                                                     self.kwargs_chunk_spec)
            self._inputs = [a[0] for a in args_split]
            self._arguments = [(a[1:], k) for a, k in zip(args_split, kwargs_split)]
            if self._script is not None and not isinstance(x, torch.Tensor):
                raise TypeError(f"torchpp pipeline: TorchScript stages take a batch tensor, got {type(x).__name__}")
            firsts = [t for t in tree_flatten((self._inputs, self._arguments))[0] if isinstance(t, torch.Tensor)]
        self._targets = split_microbatches(target, m) if self._has_last and target is not None else None
        self._weights = self._seed_weights(kind, m)
        # Each executor caches the shapes its last step exchanged; compare against those.
        signature = tuple((tuple(t.shape), t.dtype) for t in firsts)
        changed = signature != self._signatures.get(kind)
        self._signatures[kind] = signature
        self._losses.clear()
        self._outputs.clear()
        if self._script is not None:
            self._script.set_step(self._inputs or [], self._targets or [], self._weights)
        return changed

    def _seed_weights(self, kind: str, m: int) -> List[float]:
        """Each microbatch's loss factor before backward: its share of the batch (scale_grads)
        times the grad scaler's current loss scale (fp16)."""
        weights = self._loss_weights(m) if self.scale_grads else [1.0] * m
        scaler = self.grad_scaler
        if kind != "train" or scaler is None or not scaler.is_enabled():
            return weights
        # scale() also puts the scaler's scale on this device, on every rank, before unscale_.
        loss_scale = float(scaler.scale(torch.ones((), device=self.device)))
        return [w * loss_scale for w in weights]

    def _loss_weights(self, m: int) -> List[float]:
        """Each microbatch's share of the batch: by the targets' sizes (split along dim 0, as
        torch does), else by the batch input's along its chunk dimension, else equal."""
        if self._targets is not None:
            return loss_weights(self._targets)
        dim = chunk_dim_of(self.args_chunk_spec[0]) if self.args_chunk_spec else 0
        if self._inputs is not None and dim is not None and isinstance(self._inputs[0], torch.Tensor):
            return loss_weights(self._inputs, dim)
        return [1.0 / m] * m
