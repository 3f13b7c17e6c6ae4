"""Bad input makes every rank raise a clear error quickly; no rank hangs.

Each scenario runs on a fresh pipeline group (a failed step aborts its groups) and returns,
per rank, the exception type, its message and how long the rank took to fail.
"""
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from torchpp.pipeline import PipelineStage, build_schedule

FEATURES, BATCH, M = 8, 8, 4
FAIL_WITHIN_S = 15


class ReturnsDict(nn.Module):
    def forward(self, x):
        return {"hidden": x}


class ReturnsTupleWithString(nn.Module):
    def forward(self, x):
        return x, "label"


class CountsCalls(nn.Module):
    """A linear stage that counts its forward calls; subclasses misbehave from call `when` on."""

    def __init__(self, when):
        super().__init__()
        self.linear = nn.Linear(FEATURES, FEATURES)
        self.calls, self.when = 0, when


class RaisesOnMicrobatch(CountsCalls):
    """Raises in the forward of its `when`-th call."""

    def forward(self, x):
        self.calls += 1
        if self.calls == self.when:
            raise RuntimeError("boom: stage module failed on purpose")
        return self.linear(x)


class GrowsInSecondStep(CountsCalls):
    """Same input shape every step, but a wider output from call `when` on."""

    def forward(self, x):
        self.calls += 1
        y = self.linear(x)
        return torch.cat([y, y], dim=-1) if self.calls >= self.when else y


def _scenario(kind):
    rank = dist.get_rank()
    group = dist.new_group([0, 1])
    first, last = nn.Linear(FEATURES, FEATURES), nn.Linear(FEATURES, FEATURES)
    input_args = output_args = None  # given to rank 1's stage, or to rank 0's for output_args_of_first
    loss_fn = nn.functional.mse_loss
    name, m, steps = "1f1b", M, 1
    if kind == "shape_mismatch":
        input_args = torch.empty(BATCH // M, FEATURES + 3, device="meta")
    elif kind == "non_tensor":
        first = ReturnsDict()
    elif kind == "tuple_with_non_tensor":
        first = ReturnsTupleWithString()
    elif kind == "arity_mismatch":  # rank 1 expects a pair, stage 0 sends one tensor
        input_args = (torch.empty(BATCH // M, FEATURES, device="meta"), torch.empty(BATCH // M, device="meta"))
    elif kind == "output_args_of_first":  # stage 0 returns [2, 8] against its output_args' [2, 9]
        output_args = torch.empty(BATCH // M, FEATURES + 1, device="meta")
    elif kind in ("output_args_of_last", "output_args_of_scripted_last"):  # checked before the loss
        output_args = torch.empty(BATCH // M, FEATURES, dtype=torch.float64, device="meta")
        if kind == "output_args_of_scripted_last":  # checked in C++, by the TorchScript stages
            last, loss_fn = torch.jit.script(last), torch.jit.script(nn.MSELoss())
    elif kind == "m_too_small":
        name, m = "dualpipe", 2
    elif kind in ("raises_in_forward", "raises_in_eval"):
        last = RaisesOnMicrobatch(when=3)
    elif kind == "shape_changes_inside_step":
        first, steps = GrowsInSecondStep(when=M + 2), 2
    module = first if rank == 0 else last
    owner = 0 if kind == "output_args_of_first" else 1
    stages = PipelineStage(module, rank, 2, "cpu", input_args if rank == 1 else None,
                           output_args if rank == owner else None, group=group)
    if name == "dualpipe":
        stages = [stages, PipelineStage(last if rank == 0 else first, 1 - rank, 2, "cpu", group=group)]
    x, y = torch.randn(BATCH, FEATURES), torch.randn(BATCH, FEATURES)
    if kind == "batch_too_small" and rank == 0:
        x = x[: M - 1]  # rejected before rank 0's step starts, while rank 1 waits in its own
    if kind == "missing_target" and rank == 1:
        y = None
    start = time.monotonic()
    try:
        sched = build_schedule(name, stages, m, loss_fn=loss_fn)
        if kind == "output_args_of_scripted_last" and rank == 1:
            assert sched.torchscript_stages, "the scenario did not reach the TorchScript path"
        evaluates = kind == "raises_in_eval" or (kind == "step_against_eval" and rank == 1)
        run = sched.eval if evaluates else sched.step
        for _ in range(steps):
            run(x, target=y)
    except Exception as error:
        return type(error).__name__, str(error), time.monotonic() - start
    return None, "no error", time.monotonic() - start


def _run_all(kinds):
    return [_scenario(kind) for kind in kinds]


EXPECTED = {
    # kind: (exception type on every rank, or per rank; substrings every rank's message contains)
    "shape_mismatch": ("PipelineShapeError", ["stage 1 microbatch 0", "[2, 8]", "[2, 11]"]),
    "non_tensor": ("PipelineError", ["stage 0 returned a dict", "must return a Tensor or a tuple of Tensors"]),
    "tuple_with_non_tensor": ("PipelineError", ["stage 0 returned a tuple holding a str"]),
    "arity_mismatch": ("PipelineShapeError", ["stage 1 microbatch 0", "[2, 8]", "([2, 8] Float, [2] Float)"]),
    "output_args_of_first": ("PipelineShapeError", ["stage 0 microbatch 0 returned [2, 8] Float",
                                                    "expects [2, 9] Float (its output_args)"]),
    "output_args_of_last": ("PipelineShapeError", ["stage 1 microbatch 0 returned [2, 8] Float",
                                                   "expects [2, 8] Double (its output_args)"]),
    "output_args_of_scripted_last": ("PipelineShapeError", ["stage 1 microbatch 0 returned [2, 8] Float",
                                                            "expects [2, 8] Double (its output_args)"]),
    "m_too_small": ("ValueError", ["dualpipe", "m"]),
    "raises_in_forward": ("PipelineError", ["boom", "rank 1 failed at action 1F2"]),
    "raises_in_eval": ("PipelineError", ["boom", "rank 1 failed at action 1F2"]),
    "shape_changes_inside_step": ("PipelineShapeError", ["stage 0 microbatch 1", "[2, 16]", "[2, 8]"]),
    # One rank's arguments are rejected in Python: it raises its own error, the other stops.
    "batch_too_small": (("ValueError", "PipelineError"), ["(3, 8) cannot be split into 4 microbatches"]),
    "missing_target": (("PipelineError", "ValueError"), ["rank 1 holds a last stage and needs target="]),
    # Rank 0 calls step(), rank 1 eval(): caught at the step-start vote, before any message waits.
    "step_against_eval": ("PipelineError", ["while another rank of the pipeline runs", "every rank must call the same one"]),
}


@pytest.fixture(scope="module")
def outcomes(ranks):
    per_rank = ranks(2).run(_run_all, list(EXPECTED), timeout=120)
    return {kind: [r[k] for r in per_rank] for k, kind in enumerate(EXPECTED)}


@pytest.mark.parametrize("kind", list(EXPECTED))
def test_every_rank_fails_clearly(outcomes, kind):
    error_types, fragments = EXPECTED[kind]
    for rank, (raised, message, elapsed) in enumerate(outcomes[kind]):
        want = error_types if isinstance(error_types, str) else error_types[rank]
        assert raised == want, f"rank {rank}: {raised}: {message}"
        for fragment in fragments:
            assert fragment in message, f"rank {rank}: {fragment!r} not in {message!r}"
        assert elapsed < FAIL_WITHIN_S, f"rank {rank} took {elapsed:.1f}s to fail"


REPEATS = 150


def _raised_repeatedly(kind, times):
    return [_scenario(kind)[0] for _ in range(times)]


def test_failure_at_the_first_action_never_hangs_the_peer(ranks):
    """Rank 0 fails before it sends anything, while rank 1 may still wait on the step-start
    vote: repeated, since the race it guards against showed about once in 20 runs."""
    per_rank = ranks(2).run(_raised_repeatedly, "non_tensor", REPEATS, timeout=120)
    for rank, raised in enumerate(per_rank):
        assert raised == ["PipelineError"] * REPEATS, f"rank {rank}: {raised}"
