"""A rank that dies (SIGKILL) or freezes (SIGSTOP) in the middle of a pipeline step.

The ranks are plain processes (fault_utils.PlainRanks: no torchrun agent, no test harness
watching them), so what notices the fault is torchpp in the surviving ranks: a dead peer's
closed connections fail their pending receives at once; a frozen peer keeps its connections
open and is found by the bounded wait (build_schedule(timeout=)). Each case asserts every
surviving rank's error and how long after the signal it came.
"""
import os
import signal
import time

import pytest

from fault_utils import Outcome, PlainRanks, run_case

FEATURES, BATCH, M = 8, 8, 4
VICTIM_MICROBATCH = 2  # the victim stops in its forward of this microbatch, in the second step
FROZEN_TIMEOUT_S = 4.0
# A killed peer's connections close at once; the survivors then wait up to 1.5 s for a peer's
# message before reporting their own (runtime/failure.cpp).
KILLED_WITHIN_S = 6.0
# A frozen peer is found when the bounded wait runs out: the timeout plus the break's propagation.
FROZEN_WITHIN_S = FROZEN_TIMEOUT_S + 4.0
START_S = 240  # imports and the first step on a loaded 2-core machine


def _pipeline_case(ctx, victim: int, timeout: float) -> Outcome:
    """1F1B over all ranks; in the second step `victim` marks "mid_step" in its forward of
    microbatch VICTIM_MICROBATCH and waits there until the test releases it (or kills it)."""
    import torch
    from torch import nn

    from torchpp.pipeline import PipelineStage, build_schedule

    class Holds(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(FEATURES, FEATURES)
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            if ctx.rank == victim and self.calls == M + 1 + VICTIM_MICROBATCH:
                ctx.mark("mid_step")
                release = os.path.join(ctx.directory, "release")
                while not os.path.exists(release):
                    time.sleep(0.02)
            return self.linear(x)

    torch.manual_seed(0)
    stage = PipelineStage(Holds(), ctx.rank, ctx.world_size, "cpu")
    sched = build_schedule("1f1b", stage, M, loss_fn=nn.functional.mse_loss, timeout=timeout)
    x, y = torch.randn(BATCH, FEATURES), torch.randn(BATCH, FEATURES)
    sched.step(x, target=y)  # a healthy first step: headers exchanged, connections up
    return run_case(lambda: sched.step(x, target=y))


def killed_middle_rank(ctx):
    return _pipeline_case(ctx, victim=1, timeout=600)


def killed_store_host(ctx):
    return _pipeline_case(ctx, victim=0, timeout=600)


def frozen_middle_rank(ctx):
    return _pipeline_case(ctx, victim=1, timeout=FROZEN_TIMEOUT_S)


def _target(name):
    return f"{os.path.abspath(__file__)}:{name}"


@pytest.mark.timeout(420)
@pytest.mark.parametrize("case, world, victim", [("killed_middle_rank", 3, 1), ("killed_store_host", 2, 0)])
def test_sigkill_mid_step_fails_every_survivor(tmp_path, case, world, victim):
    """SIGKILL of the middle rank of three (both neighbours wait on it), and of rank 0, which
    also hosts the TCP store the failure messages would travel through."""
    with PlainRanks(world, _target(case), str(tmp_path)) as ranks:
        ranks.wait_mark(victim, "mid_step", START_S)
        killed_at = ranks.signal(victim, signal.SIGKILL)
        for rank in range(world):
            if rank == victim:
                continue
            outcome = ranks.outcome(rank, KILLED_WITHIN_S + 30)
            assert outcome.error == "PipelineError", f"rank {rank}: {outcome.error}: {outcome.message}"
            assert f"from rank {victim}" in outcome.message or f"to rank {victim}" in outcome.message, outcome.message
            waited = outcome.ended - killed_at
            assert waited < KILLED_WITHIN_S, f"rank {rank} raised {waited:.1f}s after the kill"


@pytest.mark.timeout(420)
def test_sigstop_frozen_peer_is_reported_by_the_bounded_wait(tmp_path):
    """SIGSTOP of the middle rank of three: both neighbours raise PipelineTimeoutError naming it
    once the (shortened) timeout runs out; resumed (SIGCONT), the frozen rank raises too."""
    with PlainRanks(3, _target("frozen_middle_rank"), str(tmp_path)) as ranks:
        ranks.wait_mark(1, "mid_step", START_S)
        stopped_at = ranks.signal(1, signal.SIGSTOP)
        for rank in (0, 2):
            outcome = ranks.outcome(rank, FROZEN_WITHIN_S + 30)
            assert outcome.error == "PipelineTimeoutError", f"rank {rank}: {outcome.error}: {outcome.message}"
            assert "from rank 1" in outcome.message and f"{FROZEN_TIMEOUT_S:.1f} s" in outcome.message, outcome.message
            waited = outcome.ended - stopped_at
            assert FROZEN_TIMEOUT_S * 0.9 < waited < FROZEN_WITHIN_S, f"rank {rank} raised {waited:.1f}s after SIGSTOP"
        (tmp_path / "release").write_text("")
        resumed_at = ranks.signal(1, signal.SIGCONT)
        outcome = ranks.outcome(1, 30)
        # It learns of the failure from the shared message, or from its neighbours' closed connections
        # (whichever reaches it first after SIGCONT): an error either way, never a hang.
        assert outcome.error in ("PipelineTimeoutError", "PipelineError"), f"rank 1: {outcome.error}: {outcome.message}"
        assert outcome.ended - resumed_at < 5.0, f"the resumed rank raised {outcome.ended - resumed_at:.1f}s after SIGCONT"
