"""Spawned ranks for distributed tests, with hard timeouts.

A pool of `world_size` processes initialises torch.distributed once (gloo, or NCCL with gloo
beside it for CPU tensors; FileStore) and then runs test functions on every rank. NCCL ranks
share the one GPU (torchpp.testing.one_gpu). A function that fails or hangs on any rank fails
the test with every rank's traceback; the pool is then torn down and respawned, so one
broken test cannot poison the next.
"""
from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from typing import Any, Callable, List

# Collectives that would hang become errors after this long (well under each test's timeout).
COLLECTIVE_TIMEOUT_S = 45
DEFAULT_TEST_TIMEOUT_S = 120
# Once a rank has failed the test, the others get this long to finish (or fail) too: a rank whose
# peer stopped in test code may wait in the next collective until the test's own timeout.
AFTER_FAILURE_S = 20


BACKENDS = ("gloo", "nccl")


def _worker(rank: int, world_size: int, init_file: str, tasks, results, backend: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if backend == "nccl":
        from torchpp.testing.one_gpu import share_one_gpu

        share_one_gpu(rank)
    dist.init_process_group(
        "cpu:gloo,cuda:nccl" if backend == "nccl" else "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    import torchpp  # noqa: F401

    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            results.put((rank, "ok", fn(*args, **kwargs)))
        except BaseException:  # report everything, including assertion failures
            results.put((rank, "error", traceback.format_exc()))
    dist.destroy_process_group()


class RankPool:
    """`world_size` spawned ranks that run test functions on demand, over `backend` ("gloo" or
    "nccl": CUDA tensors over NCCL, CPU tensors over gloo)."""

    def __init__(self, world_size: int, backend: str = "gloo"):
        if backend not in BACKENDS:
            raise ValueError(f"RankPool: backend must be one of {BACKENDS}, got {backend!r}")
        self.world_size = world_size
        self.backend = backend
        ctx = mp.get_context("spawn")
        self._dir = tempfile.TemporaryDirectory(prefix="torchpp_ranks_")
        init_file = os.path.join(self._dir.name, "store")
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._procs = [
            ctx.Process(target=_worker, args=(r, world_size, init_file, self._tasks[r], self._results, backend),
                        daemon=True)
            for r in range(world_size)
        ]
        for proc in self._procs:
            proc.start()
        self.healthy = True

    def run(self, fn: Callable, *args, timeout: float = DEFAULT_TEST_TIMEOUT_S, **kwargs) -> List[Any]:
        """Runs fn(*args, **kwargs) on every rank; returns the per-rank results in rank order."""
        for tasks in self._tasks:
            tasks.put((fn, args, kwargs))
        deadline = time.monotonic() + timeout
        outcomes = {}
        failed = None  # the first rank that failed
        while len(outcomes) < self.world_size:
            remaining = deadline - time.monotonic()
            dead = [r for r, p in enumerate(self._procs) if not p.is_alive() and r not in outcomes]
            if remaining <= 0 or dead:
                self.healthy = False
                missing = sorted(set(range(self.world_size)) - set(outcomes))
                errors = self._format_errors(outcomes)
                if dead:
                    reason = f"exited ({dead})"
                elif failed is not None:
                    reason = f"were still running {AFTER_FAILURE_S}s after rank {failed} failed"
                else:
                    reason = f"did not finish within {timeout:.0f}s (hang)"
                raise AssertionError(f"{fn.__name__}: ranks {missing} {reason}\n{errors}")
            try:
                rank, status, value = self._results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                continue
            outcomes[rank] = (status, value)
            if status == "error" and failed is None:
                failed = rank
                deadline = min(deadline, time.monotonic() + AFTER_FAILURE_S)
        if any(status == "error" for status, _ in outcomes.values()):
            self.healthy = False
            raise AssertionError(f"{fn.__name__} failed:\n{self._format_errors(outcomes)}")
        return [outcomes[r][1] for r in range(self.world_size)]

    @staticmethod
    def _format_errors(outcomes) -> str:
        return "\n".join(
            f"--- rank {rank} ---\n{value}" for rank, (status, value) in sorted(outcomes.items()) if status == "error"
        )

    def close(self) -> None:
        if self.healthy:
            for tasks in self._tasks:
                tasks.put(None)
            for proc in self._procs:
                proc.join(timeout=10)
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
        self._dir.cleanup()


class RankPools:
    """One live pool at a time (the machine has 2 cores), respawned after a failure."""

    def __init__(self, backend: str = "gloo"):
        self.backend = backend
        self._pool: RankPool | None = None

    def __call__(self, world_size: int) -> RankPool:
        pool = self._pool
        if pool is not None and (pool.world_size != world_size or not pool.healthy):
            pool.close()
            pool = None
        if pool is None:
            pool = self._pool = RankPool(world_size, self.backend)
        return pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None
