"""Where stages sit: torch.distributed.pipelining's stage -> rank mappings, by the same names."""
from __future__ import annotations

from typing import Dict, List

STYLES = ("loop", "v")


def generate_stage_to_rank_mapping(pp_size: int, num_stages: int, style: str = "loop") -> Dict[int, int]:
    """Stage index -> pipeline rank (torch's function of the same name).

    Args:
        pp_size: pipeline ranks.
        num_stages: stages over all ranks.
        style: "loop" puts stage s on rank s % pp_size (interleaved schedules); "v" zig-zags,
            each block of pp_size stages running the other way from the one before (V shapes:
            rank r holds r and 2 pp_size - 1 - r, ...); num_stages must be a multiple of pp_size.
    """
    if pp_size < 1 or num_stages < 1:
        raise ValueError(f"pp_size and num_stages must be positive, got pp_size={pp_size}, num_stages={num_stages}")
    if style == "loop":
        return {s: s % pp_size for s in range(num_stages)}
    if style != "v":
        raise ValueError(f"unknown stage placement style {style!r}; expected one of {STYLES}")
    if num_stages % pp_size:
        raise ValueError(f"a V placement needs num_stages ({num_stages}) divisible by pp_size ({pp_size})")
    # Even blocks go down the ranks, odd blocks come back up.
    return {s: (s % pp_size if (s // pp_size) % 2 == 0 else pp_size - 1 - s % pp_size) for s in range(num_stages)}


def generate_rank_to_stage_mapping(pp_size: int, num_stages: int, style: str = "loop") -> Dict[int, List[int]]:
    """Pipeline rank -> its stage indices in increasing order (the inverse of the above)."""
    ranks: Dict[int, List[int]] = {}
    for stage, rank in generate_stage_to_rank_mapping(pp_size, num_stages, style).items():
        ranks.setdefault(rank, []).append(stage)
    return ranks
