"""torch.distributed.pipelining's per-microbatch stage methods, for loops written by hand.

A schedule's step never calls these: its actions run in the C++ executor. They serve code that
drives a stage one microbatch at a time (torch's custom schedules, torchtitan's helpers), with
torch's names and contracts: ``forward_one_chunk``, ``backward_one_chunk``,
``backward_weight_one_chunk``, ``scale_grads``, the local hand-offs between two stages of one
rank (``set_local_fwd_input``, ``get_local_bwd_output``, ``set_local_bwd_input``), and the state
they keep (``fwd_cache``, ``bwd_cache``, ``output_chunks``, ``dw_runner``).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch.utils._pytree import tree_flatten

from torchpp.pipeline import weight_grad_store


def _as_tuple(value) -> Tuple[Any, ...]:
    return value if isinstance(value, tuple) else tuple(value) if isinstance(value, list) else (value,)


def _received(values) -> Tuple[Any, ...]:
    """Another stage's tensors as this stage's inputs: leaves of a new graph, so the backward
    stops here and their gradients are what travels back."""
    return tuple(t.detach().requires_grad_(t.is_floating_point()) if isinstance(t, torch.Tensor) else t
                 for t in _as_tuple(values))


class StageChunks:
    """Mixed into ``PipelineStage``: the per-microbatch methods and their state."""

    def _init_chunk_state(self) -> None:
        self.fwd_cache: Dict[int, Tuple[Tuple[Any, ...], List[torch.Tensor]]] = {}
        self.bwd_cache: Dict[int, Tuple[Optional[torch.Tensor], ...]] = {}
        self.output_chunks: List[Any] = []
        self.dw_runner: Dict[int, Callable[[], None]] = {}
        self._local_fwd_inputs: Dict[int, Tuple[Any, ...]] = {}
        self._local_bwd_inputs: Dict[int, Tuple[Optional[torch.Tensor], ...]] = {}
        self._has_backward = True

    @property
    def has_backward(self) -> bool:
        """Whether backward_* run (schedules set it: False for a forward-only step)."""
        return self._has_backward

    @has_backward.setter
    def has_backward(self, value: bool) -> None:
        self._has_backward = bool(value)

    def forward_one_chunk(self, fwd_chunk_id: int, args: Tuple[Any, ...], kwargs: Optional[Dict[str, Any]] = None,
                          save_forward_output: bool = True):
        """Runs the stage on microbatch ``fwd_chunk_id`` and keeps what its backward needs.

        Args:
            fwd_chunk_id: the microbatch.
            args: the first stage's inputs; other stages take theirs from ``set_local_fwd_input``
                (between ranks, the executor of a schedule moves activations in C++).
            kwargs: further keyword arguments of the stage module.
            save_forward_output: on a last stage, append the output to ``output_chunks``.
        """
        if self.is_first:
            inputs = _as_tuple(args)
        elif fwd_chunk_id in self._local_fwd_inputs:
            inputs = self._local_fwd_inputs.pop(fwd_chunk_id)
        else:
            raise RuntimeError(
                f"torchpp.PipelineStage {self.stage_index}: no input for microbatch {fwd_chunk_id}. torch's stage "
                "reads it from receive buffers its schedule filled; torchpp's executor moves activations in C++ "
                "during step(), so a hand-written loop hands them over with set_local_fwd_input(outputs, mb)")
        output = self._forward_fn(*inputs, **(kwargs or {}))
        if self.is_last and save_forward_output:
            self.output_chunks.append(output)
        tensors = [t for t in tree_flatten((inputs, kwargs or {}))[0] if isinstance(t, torch.Tensor)]
        self.fwd_cache[fwd_chunk_id] = (_as_tuple(output), tensors)
        return output

    def backward_one_chunk(self, bwd_chunk_id: int, loss: Optional[torch.Tensor] = None, full_backward: bool = True,
                           last_backward: bool = False) -> None:
        """Backward of microbatch ``bwd_chunk_id``, once per microbatch.

        Args:
            bwd_chunk_id: the microbatch.
            loss: its loss, on a last stage; other stages take the gradients of their outputs
                from ``set_local_bwd_input``.
            full_backward: True computes input and weight gradients; False the input gradients
                (torchpp's split-B/W layers park their weight gradients, as does ``dw_builder``),
                and ``backward_weight_one_chunk`` must follow.
            last_backward: accepted for torch's signature (data-parallel syncs are torchpp's
                optimizer's business, not the stage's).
        """
        if not self.has_backward:
            return
        if bwd_chunk_id not in self.fwd_cache:
            raise RuntimeError(f"torchpp.PipelineStage {self.stage_index}: backward of microbatch {bwd_chunk_id} "
                               f"before its forward_one_chunk (cached: {sorted(self.fwd_cache)})")
        outputs, inputs = self.fwd_cache.pop(bwd_chunk_id)
        if self.is_last:
            if loss is None:
                raise ValueError(f"torchpp.PipelineStage {self.stage_index}: the last stage's backward of microbatch "
                                 f"{bwd_chunk_id} needs its loss (backward_one_chunk(mb, loss=...))")
            roots, grads = [loss], [None]
        else:
            if bwd_chunk_id not in self._local_bwd_inputs:
                raise RuntimeError(f"torchpp.PipelineStage {self.stage_index}: no output gradient for microbatch "
                                   f"{bwd_chunk_id}; hand it over with set_local_bwd_input(grads, mb)")
            pairs = [(o, g) for o, g in zip(outputs, self._local_bwd_inputs.pop(bwd_chunk_id))
                     if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]
            roots, grads = [o for o, _ in pairs], [g for _, g in pairs]
        leaves = [t for t in inputs if t.requires_grad and t.is_leaf]
        for t in leaves:
            t.grad = None
        defer = not full_backward and self.dw_builder is None
        if roots:
            if defer:  # split-B/W layers park their weight gradients under this key
                with weight_grad_store.capture(self.stage_index, bwd_chunk_id):
                    torch.autograd.backward(roots, grads)
            else:
                torch.autograd.backward(roots, grads)
        self.bwd_cache[bwd_chunk_id] = tuple(t.grad if t.requires_grad and t.is_leaf else None for t in inputs)
        if self.dw_builder is not None:
            runner = self.dw_builder()
            if full_backward:
                runner()
            else:
                self.dw_runner[bwd_chunk_id] = runner
        elif defer:
            self.dw_runner[bwd_chunk_id] = lambda s=self.stage_index, m=bwd_chunk_id: weight_grad_store.run(s, m)

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward: bool = False) -> None:
        """The weight gradients ``backward_one_chunk(..., full_backward=False)`` left for later."""
        if not self.has_backward:
            return
        if bwd_chunk_id not in self.dw_runner:
            raise AssertionError(
                f"torchpp.PipelineStage {self.stage_index}: backward_weight_one_chunk for microbatch {bwd_chunk_id} "
                "without backward_one_chunk(full_backward=False) before it")
        self.dw_runner.pop(bwd_chunk_id)()

    def scale_grads(self, grad_scale_factor: int) -> None:
        """Divides this stage's parameter gradients by ``grad_scale_factor`` (torch's per-step
        scaling; torchpp's schedules weight each loss instead, see docs/pipeline.md)."""
        if grad_scale_factor != 1:
            for param in self.submod.parameters():
                if param.grad is not None:
                    param.grad.div_(grad_scale_factor)

    def set_local_fwd_input(self, prev_stage_outputs: Any, mb_index: int) -> None:
        """Hands the previous stage's output (on this rank) to this stage as microbatch ``mb_index``'s input."""
        self._local_fwd_inputs[mb_index] = _received(prev_stage_outputs)

    def get_local_bwd_output(self, mb_index: int) -> Tuple[Optional[torch.Tensor], ...]:
        """The gradients of this stage's inputs from microbatch ``mb_index``'s backward."""
        return self.bwd_cache.pop(mb_index)

    def set_local_bwd_input(self, next_stage_bwd_outputs: Tuple[Optional[torch.Tensor], ...], mb_index: int) -> None:
        """Hands the next stage's input gradients to this stage as its output gradients."""
        self._local_bwd_inputs[mb_index] = _as_tuple(next_stage_bwd_outputs)

    def clear_runtime_states(self) -> None:
        """Drops what earlier microbatches left: caches, outputs, parked weight gradients."""
        self.fwd_cache.clear()
        self.bwd_cache.clear()
        self.output_chunks.clear()
        self.dw_runner.clear()
        self._local_fwd_inputs.clear()
        self._local_bwd_inputs.clear()
