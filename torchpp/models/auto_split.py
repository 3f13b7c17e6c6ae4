"""split="auto" for ``parallelize``: a quick profile of the decoder layers, then the partitioner.

The unwrapped model's decoder layers are profiled on one microbatch (each layer called with
the arguments the model itself passes it, captured by a hook); the embedding's time is added to
the first layer and the final norm + head + loss to the last, so the first and last stage carry
them; PipeDream's dynamic program (``torchpp.plan.partition``) then picks the split minimising
the slowest pipeline rank. Under DualPipe (every stage on two ranks) the stage map given is
each stage's pipeline-0 copy, one stage per rank, so the slowest stage is minimised: each
pipeline moves at its pace. Rank 0's answer is broadcast so every rank builds the same stages.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from torchpp import plan as P
from torchpp import schedule as S
from torchpp.parallel.object_collectives import broadcast_object


class _Bound(nn.Module):
    """One decoder layer called as ``layer(hidden, *args, **kwargs)`` with the model's own extra arguments."""

    def __init__(self, layer: nn.Module, args: tuple, kwargs: dict):
        super().__init__()
        self.layer, self.args, self.kwargs = layer, args, kwargs

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.layer(hidden, *self.args, **self.kwargs)
        return out[0] if isinstance(out, (tuple, list)) else out


class _HeadLoss(nn.Module):
    """Final norm, output layer and cross entropy: the last stage's extra work."""

    def __init__(self, norm: nn.Module, head: nn.Module, labels: torch.Tensor):
        super().__init__()
        self.norm, self.head, self.labels = norm, head, labels

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.norm(hidden))
        return nn.functional.cross_entropy(logits.flatten(0, 1), self.labels.flatten())


def _parts(model: nn.Module, layout):
    """(layers, the modules after them but the head) of a model cut by ``layout``."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    after = [model.get_submodule(p) for p in layout.after]
    return list(model.get_submodule(layout.layers)), nn.Sequential(*[m for m in after if m is not head])


def placement_of(num_stages: int, pp: int, rank_of: Dict[int, int]) -> str:
    """The partitioner's name for the schedule's stage-to-rank map."""
    if all(rank_of[s] == s % pp for s in range(num_stages)):
        return "interleaved"
    if num_stages == 2 * pp and all(rank_of[s] == (s if s < pp else 2 * pp - 1 - s) for s in range(num_stages)):
        return "v-shape"
    raise NotImplementedError(f"split='auto': no partitioner placement for stage->rank map {rank_of}")


def choose_split(layer_seconds: Sequence[float], num_stages: int, pp: int, rank_of: Dict[int, int],
                 first_extra: float = 0.0, last_extra: float = 0.0) -> List[int]:
    """First decoder-layer index of each model stage after the first (``parallelize``'s ``split``).

    Args:
        layer_seconds: forward + backward seconds of each decoder layer.
        num_stages: model stages (pp x chunks per rank).
        pp: pipeline ranks.
        rank_of: pipeline rank of each model stage.
        first_extra: the embedding's seconds, charged to the first stage.
        last_extra: the final norm + head + loss seconds, charged to the last stage.
    """
    costs = [float(x) for x in layer_seconds]
    if num_stages > len(costs):
        raise ValueError(f"split='auto': {num_stages} stages need at least {num_stages} decoder layers, "
                         f"the model has {len(costs)}")
    # The first layer is always on the first stage and the last on the last, so their extras go with them.
    costs[0] += first_extra
    costs[-1] += last_extra
    chunks = num_stages // pp
    result = P.partition(costs, pp, num_chunks=chunks,
                         placement=placement_of(num_stages, pp, rank_of) if chunks > 1 else "interleaved")
    return list(result.boundaries[1:-1])


@torch.no_grad()
def _capture(model: nn.Module, layers: List[nn.Module], ids: torch.Tensor):
    """The hidden state entering the first layer and every layer's other arguments."""
    seen: list = [None] * len(layers)
    hooks = [layer.register_forward_pre_hook(
        lambda module, args, kwargs, k=k: seen.__setitem__(k, (args, kwargs)), with_kwargs=True)
        for k, layer in enumerate(layers)]
    try:
        model(input_ids=ids, use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    captured = []
    for args, kwargs in seen:
        if args:
            hidden, rest, kw = args[0], tuple(args[1:]), dict(kwargs)
        else:
            kw = dict(kwargs)
            hidden, rest = kw.pop("hidden_states"), ()
        captured.append((hidden, rest, kw))
    return captured


def profile_layers(model: nn.Module, layout, seq_len: int | None = None, repeats: int = 3):
    """Per-pass seconds (``LayerProfile``: forward, I, W) of each decoder layer, of the embedding
    and of norm + head + loss.

    Args:
        model: the unwrapped transformers causal LM.
        seq_len: tokens of the one-row sample microbatch (default: min(256, max positions)).
        repeats: timed runs per measurement (the median is kept).
    """
    config = model.config
    if seq_len is None:
        seq_len = min(256, getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", 256))
    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (1, seq_len), generator=g).to(device)
    layers, norm = _parts(model, layout)
    captured = _capture(model, layers, ids)
    blocks = [_Bound(layer, rest, kw) for layer, (_, rest, kw) in zip(layers, captured)]
    decoder = P.profile(blocks, captured[0][0], repeats=repeats)
    embedding = P.profile([model.get_input_embeddings()], ids, repeats=repeats)
    head = P.profile([_HeadLoss(norm, model.get_output_embeddings(), ids)], captured[-1][0], repeats=repeats)
    return decoder.layers, embedding.layers[0], head.layers[0]


def stage_costs(layers: Sequence, split: Sequence[int], embedding=None, head=None) -> S.Costs:
    """Per-stage F, I and W seconds of the stages ``split`` cuts ``layers`` (``LayerProfile``s)
    into, the embedding's passes on the first stage and the head's on the last."""
    bounds = [0, *split, len(layers)]
    passes = {"f": "forward_s", "i": "input_grad_s", "w": "weight_grad_s"}
    costs = {}
    for key, attr in passes.items():
        per_stage = [sum(getattr(layer, attr) for layer in layers[a:b]) for a, b in zip(bounds, bounds[1:])]
        per_stage[0] += getattr(embedding, attr) if embedding is not None else 0.0
        per_stage[-1] += getattr(head, attr) if head is not None else 0.0
        costs[key] = tuple(per_stage)
    return S.Costs(**costs)


def auto_split(model: nn.Module, num_stages: int, pp: int, rank_of: Dict[int, int], layout,
               seq_len: int | None = None) -> Tuple[List[int], Optional[S.Costs]]:
    """Profiles ``model`` on this rank and partitions it; collective: every rank gets rank 0's
    split and per-stage costs (None for a single stage)."""
    if num_stages == 1:
        return [], None
    layers, embedding, head = profile_layers(model, layout, seq_len)
    split = choose_split([layer.compute_s for layer in layers], num_stages, pp, rank_of, embedding.compute_s,
                         head.compute_s)
    answer = [split, stage_costs(layers, split, embedding, head)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        answer = broadcast_object(answer, src=0)
    return answer[0], answer[1]
