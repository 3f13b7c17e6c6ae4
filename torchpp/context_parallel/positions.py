"""Models that derive their positions themselves instead of reading the position ids they are
given: from the tokens (RoBERTa's embeddings count non-padding tokens from padding_idx + 1) or
from the length of their input (BART's decoders count 0..s-1). On a shard of the sequence both
would start again at the shard's start; under cp they read what the whole sequence gives:

- RoBERTa's convention is applied to the full batch (every cp rank holds it) and the result
  sharded as the model's position ids, which its embeddings then take as they are;
- a decoder's ``embed_positions`` is handed the rank's global positions in place of the local
  count the decoder computes;
- a position table counting the tokens it is given (TrOCR's sinusoidal one) counts every rank's
  tokens, gathered, and keeps this rank's part.

Neither kind of model tells packed rows apart (its mask ignores position ids), so sharded attention
does not split rows by them either: the loss is the unwrapped model's."""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch
from torch import nn

from torchpp.context_parallel import unshard_sequence
from torchpp.context_parallel.families import named_in

PositionRule = Callable[[Optional[torch.Tensor], Optional[torch.Tensor]], torch.Tensor]


@dataclass
class ModelPositions:
    """How a cp-wrapped model counts its positions (``ContextParallel.model_positions``)."""

    # Full-batch (input_ids, inputs_embeds) -> [b, s] position ids, used when the caller gives none.
    rule: Optional[PositionRule] = None
    # The model counts 0..s-1 itself (a position-ids argument would not be read as positions): BART's
    # decoders' embed_positions, ALiBi's biases.
    from_length: bool = False
    # Whether position ids that restart split a row into packed sequences (as transformers' masks do
    # for the models that pass them the position ids).
    packed_rows: bool = True
    owner: str = ""


def token_derived_embeddings(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """(path, module) of the embeddings whose position embedding has a padding_idx: RoBERTa's
    convention, positions counted over the non-padding tokens from padding_idx + 1."""
    found = []
    for name, module in model.named_modules():
        table = getattr(module, "position_embeddings", None)
        if isinstance(table, nn.Embedding) and table.padding_idx is not None:
            found.append((name, module))
    return found


def derives_positions(embeddings: nn.Module) -> bool:
    """Whether these embeddings say how they derive positions (transformers' RoBERTa family does)."""
    return callable(getattr(embeddings, "create_position_ids_from_input_ids", None)) and \
        callable(getattr(embeddings, "create_position_ids_from_inputs_embeds", None)) and \
        getattr(embeddings, "padding_idx", None) is not None


def length_counters(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """(path, module) of the position embeddings a decoder calls with the positions it counted
    itself (``embed_positions(..., position_ids=arange(s))``, BART's decoders and Whisper's)."""
    return [(name, module) for name, module in model.named_modules()
            if name.rpartition(".")[2] == "embed_positions"
            and "position_ids" in inspect.signature(module.forward).parameters]


# Position tables that count from the tokens they are called with (non-padding ones, from
# padding_idx + 1) in their own code, taking no position ids: handed the whole sequence's tokens.
TOKEN_COUNTERS = ("modeling_trocr.TrOCRSinusoidalPositionalEmbedding",)


def token_counters(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    return [(name, module) for name, module in model.named_modules() if named_in(module, TOKEN_COUNTERS)]


def _counting_over_the_sequence(cp, module: nn.Module) -> Callable:
    """The module's own count (``create_position_ids_from_input_ids``) run on every rank's tokens in
    order, this rank's part of it returned; its table grown first where the whole sequence needs
    more rows than it holds (as the module grows it for a long input, which a shard is not)."""
    own = module.create_position_ids_from_input_ids

    def create(input_ids, padding_idx, cache_length=0):
        every = unshard_sequence(input_ids, cp.group, dim=1, layout=cp.layout)
        rows = padding_idx + 1 + every.size(1)
        if module.weights is None or rows > module.weights.size(0):
            module.weights = module.get_embedding(rows, module.embedding_dim, padding_idx)
        return cp.shard(own(every, padding_idx, cache_length), dim=1)
    return create


def _tokens_rule(embeddings: nn.Module) -> PositionRule:
    # The class's own functions and the padding index: not the module, which stage 0 alone keeps.
    from_ids = embeddings.create_position_ids_from_input_ids
    from_embeds = embeddings.create_position_ids_from_inputs_embeds
    padding_idx = embeddings.padding_idx

    def rule(input_ids: Optional[torch.Tensor], inputs_embeds: Optional[torch.Tensor]) -> torch.Tensor:
        return from_ids(input_ids, padding_idx) if input_ids is not None else from_embeds(inputs_embeds, padding_idx)
    return rule


def decide_positions(model: nn.Module, where: str, positions: ModelPositions, alibi: bool = False,
                     splits_packed_rows: bool = True) -> None:
    """Fills ``positions`` for the whole ``model`` (before the pipeline cut, so that every rank
    decides alike) or refuses embeddings that derive positions in a way not said. ``alibi``: the
    model's attention biases count key positions by index (Bloom, MPT); ``splits_packed_rows``:
    its attention code tells packed rows apart (OpenAI GPT's does not).

    Raises:
        NotImplementedError: naming the embeddings (``where`` prefixes the message).
    """
    positions.owner = type(model).__name__
    positions.packed_rows = splits_packed_rows
    for name, embeddings in token_derived_embeddings(model):
        if not derives_positions(embeddings):
            raise NotImplementedError(f"{where}: {name}.position_embeddings has padding_idx "
                                      f"{embeddings.position_embeddings.padding_idx} (positions derived from the "
                                      f"tokens, as RoBERTa's are) but {name} does not say how it derives them "
                                      f"(create_position_ids_from_input_ids), so the whole sequence's cannot be "
                                      f"given to a shard")
        positions.rule = positions.rule or _tokens_rule(embeddings)
        positions.packed_rows = False
    # (ALiBi models, Bloom's and MPT's, count by index in their biases alike: positions.py's callers.)
    counts_itself = bool(length_counters(model)) or bool(token_counters(model)) or alibi
    if counts_itself and "position_ids" not in inspect.signature(model.forward).parameters:
        positions.from_length = True
        positions.packed_rows = False


def _global_positions(cp):
    def hook(module, args, kwargs):
        given = kwargs.get("position_ids")
        if given is None:  # (MVP's and TrOCR's decoders leave the count to it: their tables take [s] positions)
            tokens = args[0] if args else kwargs.get("input_ids", kwargs.get("input"))
            shape = tokens.shape if isinstance(tokens, torch.Tensor) else tokens  # (RoFormer's passes a shape)
            if not isinstance(shape, (torch.Size, tuple)) or len(shape) < 2:
                raise NotImplementedError(f"torchpp context parallelism: {type(module).__name__} is called without "
                                          f"position_ids or an input it counts from, so it would count this rank's "
                                          f"shard from 0")
            device = tokens.device if isinstance(tokens, torch.Tensor) else next(module.parameters()).device
            kwargs["position_ids"] = cp.positions(shape[1] * cp.size, device)
            return args, kwargs
        local = given.size(-1)
        kwargs["position_ids"] = cp.positions(local * cp.size, given.device).expand_as(given)
        return args, kwargs
    return hook


def apply_positions(model: nn.Module, cp) -> None:
    """Hands this rank's position embeddings that count from the input's length the whole
    sequence's positions (``cp.model_positions``, decided on the whole model)."""
    if not cp.model_positions.from_length:
        return
    for _, module in length_counters(model):
        if not getattr(module, "_torchpp_global_positions", False):  # (the recompute pass applies cp again)
            module.register_forward_pre_hook(_global_positions(cp), with_kwargs=True)
            module._torchpp_global_positions = True
    for _, module in token_counters(model):
        if not getattr(module, "_torchpp_counts_the_sequence", False):  # (the recompute pass applies cp again)
            module.create_position_ids_from_input_ids = _counting_over_the_sequence(cp, module)
            module._torchpp_counts_the_sequence = True


def check_given(positions: ModelPositions, position_ids: torch.Tensor) -> None:
    """Refuses position ids a model counting its own (0..s-1 per row) would not read as positions."""
    if not positions.from_length:
        return
    expected = torch.arange(position_ids.size(-1), device=position_ids.device)
    if not bool((position_ids == expected).all()):
        raise ValueError(f"torchpp context parallelism: {positions.owner} counts its positions from its input's "
                         f"length (0..{position_ids.size(-1) - 1} in every row): it cannot take other position_ids "
                         f"(packed rows, offsets); call it without them")
