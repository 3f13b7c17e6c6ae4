"""Pipeline faults on spawned gloo ranks: every rank ends with a clear error, in seconds.

A rank raising in backward; ranks that disagree on n_microbatches, the schedule, the dtype or
the hidden size; a peer that stops answering (the bounded wait); m < p; DualPipe on an odd
number of ranks; malformed, deadlocking and per-rank different schedule CSVs. Each case runs
on a fresh pipeline group (a failed step breaks its groups) and returns every rank's Outcome
(fault_utils): its error type, message and time to reach it.
"""
import math
import os
import sys
import tempfile
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fault_utils import FailsBackward, assert_outcomes, run_case
from torchpp import schedule as S
from torchpp.pipeline import PipelineStage, build_schedule

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "distributed"))
from pipeline_checks import train_and_compare  # noqa: E402

FEATURES, BATCH, M = 8, 8, 4
WITHIN_S = 10.0  # every case but the stuck peer ends well within this
STUCK_TIMEOUT_S = 3.0



class Stage(nn.Module):
    """A linear stage; `fail_backward_at` makes its backward of that call's microbatch raise,
    `stuck_at` makes that forward call wait for `release` (a file) as a hung rank would."""

    def __init__(self, width=FEATURES, fail_backward_at=None, stuck_at=None, release=None):
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.calls = 0
        self.fail_backward_at, self.stuck_at, self.release = fail_backward_at, stuck_at, release

    def forward(self, x):
        self.calls += 1
        if self.calls == self.stuck_at:
            deadline = time.monotonic() + 60
            while not os.path.exists(self.release) and time.monotonic() < deadline:
                time.sleep(0.02)
        y = self.linear(x)
        return FailsBackward.apply(y) if self.calls == self.fail_backward_at else y


def _csv(text: str) -> str:
    path = os.path.join(tempfile.mkdtemp(prefix="torchpp_fault_csv_"), f"rank{dist.get_rank()}.csv")
    with open(path, "w") as f:
        f.write(text)
    return path


CSV_1F1B = "0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n"
CSV_GPIPE = "0F0,0F1,0B0,0B1\n1F0,1F1,1B0,1B1\n"
CSVS = {
    "csv_malformed": "0F0,0F1,0B0,0B1\n1F0,1X0,1F1,1B1\n",
    "csv_incomplete": "0F0,0F1,0B0\n1F0,1B0,1F1,1B1\n",
    "csv_deadlock": "0F0,0B0,0F1,0B1\n1F1,1F0,1B0,1B1\n",
}


def _case(kind: str, shared_dir: str):
    """Builds this rank's side of case `kind` on a fresh group and runs one step (two for the
    ones that fail in the second); returns the Outcome."""
    rank = dist.get_rank()
    group = dist.new_group([0, 1])
    name, m, width, dtype, input_args = "1f1b", M, FEATURES, torch.float32, None
    options = {}
    stage_options = {}
    if kind == "raises_in_backward" and rank == 1:
        stage_options = dict(fail_backward_at=3)
    elif kind == "raises_in_split_backward":
        name = "zb-h1"
        if rank == 1:
            stage_options = dict(fail_backward_at=3)
    elif kind == "mismatched_m" and rank == 1:
        m = 2 * M
    elif kind == "mismatched_schedule" and rank == 1:
        name = "zb-h1"
    elif kind == "mismatched_dtype" and rank == 1:
        dtype = torch.float64
    elif kind in ("mismatched_hidden", "mismatched_hidden_input_args") and rank == 1:
        width = 2 * FEATURES
        if kind == "mismatched_hidden_input_args":
            input_args = torch.empty(BATCH // M, width, device="meta")
    elif kind == "stuck_peer":
        options = dict(timeout=STUCK_TIMEOUT_S)
        if rank == 0:  # hangs in its forward of microbatch 2 until rank 1 has raised
            stage_options = dict(stuck_at=3, release=os.path.join(shared_dir, "rank1_raised"))
    elif kind == "csv_differs_per_rank":  # two valid CSVs, one per rank: only the action lists differ
        name = S.from_csv(_csv(CSV_1F1B if rank == 0 else CSV_GPIPE), num_ranks=2, num_microbatches=2)
        m = 2
    torch.manual_seed(0)
    module = Stage(width, **stage_options).to(dtype)
    stage = PipelineStage(module, rank, 2, "cpu", input_args, group=group)
    x = torch.randn(BATCH, FEATURES, dtype=dtype)
    y = torch.randn(BATCH, width, dtype=dtype)  # the loss uses the target

    def run():
        if kind in CSVS:
            S.from_csv(_csv(CSVS[kind]), num_ranks=2, num_microbatches=2)
        sched = build_schedule(name, stage, m, loss_fn=nn.functional.mse_loss, **options)
        sched.step(x, target=y)

    outcome = run_case(run)
    if kind == "stuck_peer" and rank == 1:
        open(os.path.join(shared_dir, "rank1_raised"), "w").close()
    return outcome


def _run_all(kinds, shared_dir):
    return [_case(kind, shared_dir) for kind in kinds]


EXPECTED = {
    # kind: (error on every rank, or per rank; fragments every rank's message holds)
    "raises_in_backward": ("PipelineError", ["boom: backward failed on purpose", "rank 1 failed at action 1B2"]),
    "raises_in_split_backward": ("PipelineError", ["boom: backward failed on purpose", "rank 1 failed at action 1I2"]),
    # The fingerprint in the step-start vote: found before any message, named on every rank.
    "mismatched_m": ("PipelineConfigError", ["n_microbatches: 4 on rank 0, 8 on rank 1",
                                             "build the same schedule"]),
    "mismatched_schedule": ("PipelineConfigError", ["schedule: 1f1b on rank 0, zb-h1 on rank 1"]),
    "mismatched_dtype": ("PipelineConfigError", ["parameter dtype: float32 on rank 0, float64 on rank 1"]),
    "csv_differs_per_rank": ("PipelineConfigError", ["lowered actions (hash):"]),
    # Stage 1 built for another hidden size: its forward fails on the received shape, which the error names.
    "mismatched_hidden": ("PipelineError", ["rank 1 failed at action 1F0", "mat1 and mat2",
                                            "stage 1's input from stage 0 was [2, 8] Float"]),
    "mismatched_hidden_input_args": ("PipelineShapeError", ["stage 1 microbatch 0", "[2, 8] Float", "[2, 16] Float"]),
    # Malformed, incomplete and deadlocking CSVs are refused on every rank before anything runs.
    "csv_malformed": ("ValueError", ["invalid action string '1X0'"]),
    "csv_incomplete": ("ScheduleError", ["stage 0 microbatch 1 has no I or B"]),
    "csv_deadlock": ("ScheduleError", ["deadlocks", "0B0 waits for the input gradient of stage 1 microbatch 0"]),
}


@pytest.fixture(scope="module")
def outcomes(ranks, tmp_path_factory):
    kinds = list(EXPECTED) + ["stuck_peer"]
    shared = str(tmp_path_factory.mktemp("faults"))
    per_rank = ranks(2).run(_run_all, kinds, shared, timeout=240)
    return {kind: [r[k] for r in per_rank] for k, kind in enumerate(kinds)}


@pytest.mark.parametrize("kind", list(EXPECTED))
def test_every_rank_fails_clearly(outcomes, kind):
    error, fragments = EXPECTED[kind]
    assert_outcomes(outcomes[kind], error, fragments, within_s=WITHIN_S)


def test_stuck_peer_is_reported_by_the_bounded_wait(outcomes):
    """Rank 0 hangs in a forward; rank 1, waiting for that activation, gives up after the
    timeout naming the action and the peer; rank 0 raises the same once it resumes."""
    waiting, stuck = outcomes["stuck_peer"][1], outcomes["stuck_peer"][0]
    assert_outcomes([waiting], "PipelineTimeoutError",
                    ["rank 1 failed at action 1F2", "waited 3.", "the activation for stage 1 microbatch 2 from rank 0",
                     "the pipeline timeout"], within_s=STUCK_TIMEOUT_S + 5)
    assert waiting.elapsed > STUCK_TIMEOUT_S, waiting.elapsed
    assert_outcomes([stuck], "PipelineTimeoutError", ["because another rank failed", "from rank 0"],
                    within_s=STUCK_TIMEOUT_S + 10)
    assert stuck.ended - waiting.ended < 5.0, "the resumed rank took too long to stop"


def test_m_below_p_trains_exactly(ranks):
    """m < p is a valid (bubble-heavy) schedule: losses and gradients equal the reference."""
    names = ("1f1b", "zb-h1", "interleaved-1f1b", "zb-v")
    per_rank = ranks(2).run(_train_m1, names, timeout=240)
    for index, name in enumerate(names):
        for step in range(len(per_rank[0][index]["steps"])):
            total = sum(r[index]["steps"][step]["loss_share"] for r in per_rank)
            ref = per_rank[0][index]["steps"][step]["ref_loss"]
            assert math.isclose(total, ref, rel_tol=1e-10), (name, step, total, ref)


def _train_m1(names):
    return [train_and_compare(name, m=1, batch=2) for name in names]


def _dualpipe(m):
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(world)))
    stages = [PipelineStage(nn.Linear(FEATURES, FEATURES), k, world, "cpu", group=group)
              for k in sorted({rank, world - 1 - rank})]
    return run_case(lambda: build_schedule("dualpipe", stages, m, loss_fn=nn.functional.mse_loss))


def test_dualpipe_needs_m_at_least_2p(ranks):
    assert_outcomes(ranks(2).run(_dualpipe, 2, timeout=60), "ValueError",
                    ["dualpipe: requires m >= 2p (got p=2, m=2"], within_s=WITHIN_S)


def test_dualpipe_on_an_odd_number_of_ranks(ranks):
    assert_outcomes(ranks(3).run(_dualpipe, 6, timeout=120), "ValueError",
                    ["dualpipe: requires an even number of ranks p (got p=3"], within_s=WITHIN_S)
