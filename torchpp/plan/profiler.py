"""Per-layer profile of a chain of blocks: times of F, I and W, activation and parameter bytes."""
from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import nn

from torchpp.plan.saved_activations import SavedActivationMeter


@dataclass(frozen=True)
class LayerProfile:
    """One block's costs for one microbatch (seconds are medians over repeats)."""

    name: str
    forward_s: float
    input_grad_s: float  # I: backward for the block's input only
    weight_grad_s: float  # W: backward for its parameters only
    output_bytes: int
    saved_bytes: int
    parameter_bytes: int

    @property
    def compute_s(self) -> float:
        return self.forward_s + self.input_grad_s + self.weight_grad_s


@dataclass(frozen=True)
class Profile:
    """The profile of a chain of blocks, in order."""

    layers: list[LayerProfile]
    device: str
    repeats: int
    spread: dict[str, float] = field(default_factory=dict)  # largest (max-min)/median per time kind

    @property
    def compute_times(self) -> list[float]:
        return [layer.compute_s for layer in self.layers]

    @property
    def output_bytes(self) -> list[int]:
        return [layer.output_bytes for layer in self.layers]

    @property
    def saved_bytes(self) -> list[int]:
        return [layer.saved_bytes for layer in self.layers]

    @property
    def parameter_bytes(self) -> list[int]:
        return [layer.parameter_bytes for layer in self.layers]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> "Profile":
        raw = json.loads(text)
        return cls(layers=[LayerProfile(**layer) for layer in raw["layers"]], device=raw["device"],
                   repeats=raw["repeats"], spread=raw.get("spread", {}))


def profile(
    model: nn.Module | Sequence[nn.Module],
    sample_batch: torch.Tensor,
    *,
    repeats: int = 5,
    warmup: int = 1,
    blocks: Sequence[nn.Module] | None = None,
) -> Profile:
    """Measures each block of a chain on one microbatch.

    The sample flows block to block; each block is timed on its own (its input detached) for the
    forward, the input gradient (I, ``torch.autograd.grad`` on the input only) and the weight
    gradient (W, then on the parameters only); saved-activation bytes come from
    ``saved_tensors_hooks``. Times on an accelerator use device events.

    Args:
        model: an ``nn.Sequential``/``nn.ModuleList`` or list of blocks, each taking the previous
            block's output (a tuple output passes on its first element).
        sample_batch: the first block's input, one microbatch, on the device to profile.
        repeats: timed runs per measurement; the median is kept.
        warmup: untimed runs before timing.
        blocks: the chain to profile when ``model`` is not itself one.

    Returns:
        A ``Profile`` with one ``LayerProfile`` per block.
    """
    chain = list(blocks if blocks is not None else model)
    if not chain:
        raise ValueError("profile needs at least one block")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    device = sample_batch.device
    timer = _timer(device)
    layers, spreads = [], {"forward": 0.0, "input_grad": 0.0, "weight_grad": 0.0}
    x = sample_batch
    for index, block in enumerate(chain):
        layer, x, spread = _profile_block(f"{index}:{type(block).__name__}", block, x, repeats, warmup, timer)
        layers.append(layer)
        for kind, value in spread.items():
            spreads[kind] = max(spreads[kind], value)
    return Profile(layers=layers, device=str(device), repeats=repeats, spread=spreads)


def _first_tensor(output: Any) -> torch.Tensor:
    return output[0] if isinstance(output, (tuple, list)) else output


def _profile_block(name, block, x, repeats, warmup, timer):
    params = [p for p in block.parameters() if p.requires_grad]
    x = x.detach()
    needs_input_grad = x.is_floating_point()
    if needs_input_grad:
        x.requires_grad_(True)

    def forward() -> torch.Tensor:
        return _first_tensor(block(x))

    def input_grad(out, grad) -> None:
        if needs_input_grad:
            torch.autograd.grad(out, x, grad, retain_graph=True)

    def weight_grad(out, grad) -> None:
        if params:
            torch.autograd.grad(out, params, grad, allow_unused=True)

    with torch.no_grad():
        forward_times = _measure(lambda: forward(), repeats, warmup, timer)
    input_times, weight_times = [], []
    for run in range(warmup + repeats):
        out = forward()
        grad = torch.ones_like(out)
        i_time = timer(lambda: input_grad(out, grad))
        w_time = timer(lambda: weight_grad(out, grad))
        if run >= warmup:
            input_times.append(i_time)
            weight_times.append(w_time)
    with SavedActivationMeter(exclude=[x] if not needs_input_grad else []) as meter:
        out = forward()
    layer = LayerProfile(
        name=name,
        forward_s=statistics.median(forward_times),
        input_grad_s=statistics.median(input_times) if needs_input_grad else 0.0,
        weight_grad_s=statistics.median(weight_times) if params else 0.0,
        output_bytes=out.numel() * out.element_size(),
        saved_bytes=meter.peak_bytes,
        parameter_bytes=sum(p.numel() * p.element_size() for p in block.parameters()),
    )
    spread = {kind: _relative_spread(times) for kind, times in
              (("forward", forward_times), ("input_grad", input_times), ("weight_grad", weight_times))}
    return layer, out.detach(), spread


def _relative_spread(times: list[float]) -> float:
    middle = statistics.median(times)
    return (max(times) - min(times)) / middle if middle > 0 else 0.0


def _measure(fn: Callable[[], Any], repeats: int, warmup: int, timer) -> list[float]:
    for _ in range(warmup):
        fn()
    return [timer(fn) for _ in range(repeats)]


def _timer(device: torch.device) -> Callable[[Callable[[], Any]], float]:
    """Seconds of one call: host clock on CPU, device events elsewhere (kernels run late)."""
    if device.type == "cpu":
        def host(fn):
            start = time.perf_counter()
            fn()
            return time.perf_counter() - start
        return host

    def events(fn):
        start, end = torch.Event(device=device, enable_timing=True), torch.Event(device=device, enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    return events
