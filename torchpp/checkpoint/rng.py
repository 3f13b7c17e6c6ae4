"""Per-rank RNG states: torch's default generators and the TP RNG tracker's streams.

Streams belong to a place in the layout, not to a parameter: a rank's key is its
(pp, tp, dp) coordinate. Default streams are equal across DP replicas (same seed, same
draws), so a checkpoint restores RNG exactly whenever pp and tp are unchanged; after a tp or
pp change there is no rank whose streams this rank should continue, and RNG is left as is.
"""
from __future__ import annotations

import re
from typing import Any, Dict, Iterable, Optional, Tuple

import torch

from torchpp.parallel.groups import ParallelState
from torchpp.tensor_parallel.random import get_rng_tracker

PREFIX = "rng."
_KEY = re.compile(r"^rng\.pp(\d+)\.tp(\d+)\.dp(\d+)$")


def rng_key(pp_rank: int, tp_rank: int, dp_rank: int) -> str:
    return f"{PREFIX}pp{pp_rank}.tp{tp_rank}.dp{dp_rank}"


def capture_rng() -> Dict[str, Any]:
    """This process's RNG states (CPU, the current accelerator when there is one, TP tracker)."""
    states: Dict[str, Any] = {"cpu": torch.get_rng_state(), "tracker": get_rng_tracker().get_states()}
    if torch.accelerator.is_available():
        device = torch.accelerator.current_accelerator().type
        states[device] = torch.get_device_module(device).get_rng_state()
    return states


def restore_rng(states: Dict[str, Any]) -> None:
    """Inverse of capture_rng."""
    torch.set_rng_state(states["cpu"])
    get_rng_tracker().set_states(states["tracker"])
    for device, value in states.items():
        if device not in ("cpu", "tracker"):
            torch.get_device_module(device).set_rng_state(value)


def saved_layout(keys: Iterable[str]) -> Optional[Tuple[int, int, int]]:
    """(pp, tp, dp) of the ranks that wrote the RNG keys among `keys`, or None if none did."""
    coords = [tuple(int(g) for g in m.groups()) for m in map(_KEY.match, keys) if m]
    if not coords:
        return None
    return tuple(max(c[i] for c in coords) + 1 for i in range(3))


def source_key(keys: Iterable[str], state: ParallelState) -> Optional[str]:
    """The key whose streams this rank continues, or None when the layout changed tp or pp."""
    layout = saved_layout(keys)
    if layout is None or layout[:2] != (state.pp, state.tp):
        return None
    dp_rank = state.dp_rank if layout[2] == state.dp else 0  # DP replicas share their streams
    return rng_key(state.pp_rank, state.tp_rank, dp_rank)
