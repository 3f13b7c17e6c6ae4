"""Shared pieces of the fault suite: outcomes per rank, and ranks launched as plain processes.

Most cases run on the `ranks` fixture (tests/harness.py) and return each rank's `Outcome`.
A case that kills or freezes a rank cannot: the harness would be what notices the dead rank.
`PlainRanks` starts each rank as its own Python process (no torchrun agent, no harness), the
way a job is launched by hand: `init_process_group` over a TCP store hosted by rank 0. The test
process only sends the signal and reads what each rank reported, so whatever notices the fault
is torchpp (or torch) inside the surviving ranks.

A plain rank runs `python fault_utils.py <rank> <world> <port> <dir> <file.py>:<function>`: it
joins the group, calls the function with a `RankContext` and writes the returned (or raised)
outcome to `<dir>/outcome_<rank>.json`.
"""
from __future__ import annotations

import dataclasses
import datetime
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
from typing import Callable, Dict, List, Optional

import torch

# A plain rank's process group timeout: a case that hangs fails at this bound, not at gloo's 30 minutes.
PLAIN_GROUP_TIMEOUT_S = 60


class FailsBackward(torch.autograd.Function):
    """Identity whose backward raises: a stage that fails in its backward pass."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("boom: backward failed on purpose")


@dataclasses.dataclass
class Outcome:
    """How one rank's part of a case ended and when (time.monotonic(), the same clock in every
    process of the machine)."""

    error: Optional[str]  # exception type name; None: no error
    message: str
    started: float
    ended: float

    @property
    def elapsed(self) -> float:
        return self.ended - self.started


def run_case(fn: Callable[[], object]) -> Outcome:
    """Runs `fn` and records how it ended: its exception's type and message, or no error."""
    started = time.monotonic()
    try:
        result = fn()
    except Exception as error:  # the outcome under test
        return Outcome(type(error).__name__, str(error), started, time.monotonic())
    return Outcome(None, repr(result), started, time.monotonic())


def assert_outcomes(outcomes: List[Outcome], error, fragments=(), within_s: float = 15.0) -> None:
    """Every rank raised `error` (a type name, or one per rank) whose message holds each of
    `fragments`, within `within_s` seconds of its start."""
    for rank, outcome in enumerate(outcomes):
        want = error if isinstance(error, str) or error is None else error[rank]
        assert outcome.error == want, f"rank {rank}: {outcome.error}: {outcome.message}"
        for fragment in fragments:
            assert fragment in outcome.message, f"rank {rank}: {fragment!r} not in {outcome.message!r}"
        assert outcome.elapsed < within_s, f"rank {rank} took {outcome.elapsed:.1f}s (bound {within_s}s)"


# ---- plain processes ----


@dataclasses.dataclass
class RankContext:
    """What a plain rank's case function gets."""

    rank: int
    world_size: int
    directory: str

    def mark(self, name: str) -> None:
        """Tells the test process this rank reached `name` (see PlainRanks.wait_mark)."""
        path = os.path.join(self.directory, f"mark_{self.rank}_{name}")
        with open(path + ".tmp", "w") as f:
            f.write(str(time.monotonic()))
        os.replace(path + ".tmp", path)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class PlainRanks:
    """`world_size` ranks started as plain processes, each running `target` ("file.py:function").

    Use as a context manager: leaving it kills whatever is still running.
    """

    def __init__(self, world_size: int, target: str, directory: str, env: Optional[Dict[str, str]] = None):
        self.world_size = world_size
        self.directory = directory
        port = _free_port()
        child_env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
        tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        child_env["PYTHONPATH"] = os.pathsep.join([tests, child_env.get("PYTHONPATH", "")])
        self.procs = []
        for rank in range(world_size):
            with open(self._log(rank), "w") as log:  # a file, not a pipe nobody reads while the rank runs
                self.procs.append(subprocess.Popen(
                    [sys.executable, os.path.abspath(__file__), str(rank), str(world_size), str(port), directory,
                     target], env=child_env, stdout=log, stderr=subprocess.STDOUT))

    def _log(self, rank: int) -> str:
        return os.path.join(self.directory, f"log_{rank}.txt")

    def __enter__(self) -> "PlainRanks":
        return self

    def __exit__(self, *exc) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)  # a stopped process would not die of SIGKILL's cleanup
                proc.kill()
        for proc in self.procs:
            proc.wait()

    def wait_mark(self, rank: int, name: str, timeout: float) -> float:
        """Waits until `rank` reached mark `name`; returns when it did (time.monotonic())."""
        path = os.path.join(self.directory, f"mark_{rank}_{name}")
        deadline = time.monotonic() + timeout
        while not os.path.exists(path):
            if time.monotonic() > deadline or self.procs[rank].poll() is not None:
                raise AssertionError(f"rank {rank} did not reach {name!r} within {timeout}s\n{self.logs()}")
            time.sleep(0.02)
        with open(path) as f:
            return float(f.read())

    def signal(self, rank: int, sig: int) -> float:
        """Sends `sig` to `rank`; returns when (time.monotonic())."""
        self.procs[rank].send_signal(sig)
        return time.monotonic()

    def outcome(self, rank: int, timeout: float) -> Outcome:
        """What `rank` reported, waiting at most `timeout` seconds for it."""
        path = os.path.join(self.directory, f"outcome_{rank}.json")
        deadline = time.monotonic() + timeout
        while not os.path.exists(path):
            if time.monotonic() > deadline:
                raise AssertionError(f"rank {rank} reported nothing within {timeout}s (hang)\n{self.logs()}")
            if self.procs[rank].poll() is not None and not os.path.exists(path):
                raise AssertionError(f"rank {rank} exited ({self.procs[rank].returncode}) without an outcome\n"
                                     f"{self.logs()}")
            time.sleep(0.02)
        with open(path) as f:
            return Outcome(**json.load(f))

    def logs(self) -> str:
        """What the ranks printed so far (for failure messages)."""
        texts = []
        for rank, proc in enumerate(self.procs):
            with open(self._log(rank), errors="replace") as log:
                texts.append(f"--- rank {rank} (exit {proc.poll()}) ---\n{log.read()[-4000:]}")
        return "\n".join(texts)


def _plain_rank_main(argv: List[str]) -> None:
    rank, world_size, port = int(argv[0]), int(argv[1]), int(argv[2])
    directory, target = argv[3], argv[4]
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=PLAIN_GROUP_TIMEOUT_S))
    import torchpp  # noqa: F401

    path, name = target.rsplit(":", 1)
    spec = importlib.util.spec_from_file_location("fault_case", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    context = RankContext(rank, world_size, directory)
    try:
        outcome = getattr(module, name)(context)
    except BaseException:
        outcome = Outcome("crash", traceback.format_exc(), 0.0, time.monotonic())
    out = os.path.join(directory, f"outcome_{rank}.json")
    with open(out + ".tmp", "w") as f:
        json.dump(dataclasses.asdict(outcome), f)
    os.replace(out + ".tmp", out)
    # No destroy_process_group: the group is broken when a peer died, and the test reads the file.
    os._exit(0)


if __name__ == "__main__":
    _plain_rank_main(sys.argv[1:])
