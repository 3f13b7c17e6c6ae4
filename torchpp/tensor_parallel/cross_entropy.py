"""Cross entropy over vocabulary-parallel logits, without gathering them.

Three all-reduces over the TP group of per-token scalars replace the all-gather of the
[tokens, vocab] logits: the max (for stability), the target's logit (only its owner has
it), and the sum of exponentials.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from torchpp import ops


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, group, ignore_index: int, vocab_size) -> torch.Tensor:
        vocab_per_rank = logits.size(-1)
        vocab_start = dist.get_rank(group) * vocab_per_rank
        ctx.logits_dtype = logits.dtype
        compute_dtype = torch.float32 if logits.dtype in (torch.float16, torch.bfloat16) else logits.dtype
        logits = logits.to(compute_dtype)
        padded_from = None if vocab_size is None else max(0, vocab_size - vocab_start)
        if padded_from is not None and padded_from < vocab_per_rank:
            # Padding columns (ids >= vocab_size) get exp(-inf) = 0: no probability, no gradient.
            logits = logits.clone() if logits.dtype == ctx.logits_dtype else logits
            logits[..., padded_from:] = float("-inf")

        logits_max = logits.max(dim=-1).values
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - logits_max.unsqueeze(-1)

        ignored = target == ignore_index
        outside = (target < vocab_start) | (target >= vocab_start + vocab_per_rank) | ignored
        local_target = (target - vocab_start).masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        dist.all_reduce(target_logit, group=group)

        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)
        loss = (sum_exp.log() - target_logit).masked_fill(ignored, 0.0)

        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, outside, ignored)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        softmax, local_target, outside, ignored = ctx.saved_tensors
        # d loss / d logit = softmax - onehot(target), the onehot only on the target's owner.
        grad = softmax.clone()
        onehot = (~outside).to(grad.dtype).unsqueeze(-1)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -onehot)
        grad.mul_(grad_loss.masked_fill(ignored, 0.0).unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    group: ops.GroupLike = None,
    *,
    ignore_index: int = -100,
    reduction: str = "none",
    sequence_parallel: bool = False,
    sequence_dim: int = 0,
    vocab_size: Optional[int] = None,
) -> torch.Tensor:
    """Cross entropy of logits split over the vocabulary (last dim) across the TP group.

    Equals ``F.cross_entropy`` on the gathered logits, gradients included.

    Args:
        logits: [..., vocab / tp] this rank's slice of the vocabulary (a ColumnParallelLinear
            output without gather_output).
        target: [...] class indices into the full vocabulary.
        group: the TP ProcessGroup, its name, or None for the default group.
        ignore_index: targets equal to it contribute no loss and no gradient.
        reduction: "none" (per-token losses), "sum", or "mean" (over non-ignored tokens).
        sequence_parallel: with reduction="none", return this rank's slice of the per-token
            losses along ``sequence_dim`` (the sequence-parallel layout).
        sequence_dim: the sequence dimension of ``target``.
        vocab_size: the true vocabulary size when the logits' vocabulary was padded to a
            multiple of the TP size (``VocabParallelEmbedding(pad_vocab=True)``): columns at
            or above it are left out of the softmax. None: no padding.
    """
    if reduction not in ("none", "sum", "mean"):
        raise ValueError(f"torchpp.vocab_parallel_cross_entropy: unknown reduction {reduction!r}")
    if logits.shape[:-1] != target.shape:
        raise ValueError(
            f"torchpp.vocab_parallel_cross_entropy: logits {tuple(logits.shape)} and target "
            f"{tuple(target.shape)} disagree (logits must be target's shape plus the vocabulary dim)"
        )
    resolved = ops.group_of(group)
    losses = _VocabParallelCrossEntropy.apply(logits, target, resolved, ignore_index, vocab_size)
    if reduction == "sum":
        return losses.sum()
    if reduction == "mean":
        return losses.sum() / (target != ignore_index).sum().clamp(min=1)
    if sequence_parallel:
        return ops.scatter_to_sp_region(losses, resolved, dim=sequence_dim)
    return losses
