"""Fault suite, checkpoint faults: a job killed at every point of a checkpoint save and commit.

A 2-rank job (dp=2, ZeRO-1, so each rank writes its own shard; dropout on, so resuming must
restore the RNG) trains a GPT and saves every SAVE_EVERY steps. The save of CRASH_STEP is
interrupted: one rank calls os._exit() right before its k-th file-system operation of that
save (or right after the last one), for every k on every rank, and the launcher then kills
the other rank as torchrun's agent would. A fresh job is then started on the same directory
and must, on every rank: load the previous checkpoint explicitly, resume from the latest one
(the previous one if the crash came before the step directory's rename, the interrupted one,
adopted, if after), save the remaining checkpoints without an error, and reproduce the
uninterrupted run's losses and final parameters bit for bit, within BOUND_S seconds.

The same is done when the interrupted save has to replace a partial step directory first (a
complete one corrupted by deleting a file): loading refuses it with a warning naming the
missing file and resumes from the previous checkpoint, and its save replaces it, interrupted
at every point too. Asking for a missing or a partial step raises a clear error on every rank.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import shutil
import signal
import tempfile
import time
import warnings
from dataclasses import dataclass
from typing import List, Optional

import pytest
import torch

SAVE_EVERY, CRASH_STEP, TOTAL_STEPS, WORLD = 2, 4, 6, 2
CRASH_EXIT = 17  # the exit status of the rank killed at the injected point
BOUND_S = 60  # a restarted job's whole run (load, train, save), on every rank
JOB_TIMEOUT_S = 120  # the launcher's hard limit for one job (a hang fails the test)
BATCH, LR = 8, 1e-2


# ---- one job: a rank of a 2-rank training run that resumes from `root` if it can ----
@dataclass
class Crash:
    """Interrupt the save of step CRASH_STEP: `rank` exits right before its `index`-th
    file-system operation of that save (index == the number of operations: right after the
    last). index None: record the operations instead."""

    rank: int
    index: Optional[int]


def _batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, 32, (BATCH, 8), generator=g), torch.randint(0, 32, (BATCH, 8), generator=g)


class Injector:
    """Counts this rank's file-system operations while armed and exits at the chosen one."""

    def __init__(self, index: Optional[int], root: str):
        self.index, self.root, self.armed, self.ops = index, root, False, []

    def reached(self, label: str) -> None:
        if not self.armed:
            return
        if self.index is not None and len(self.ops) == self.index:
            os._exit(CRASH_EXIT)  # no cleanup, no finally: as a kill would
        self.ops.append(label)

    def wrap(self, owner, attr: str) -> None:
        original = getattr(owner, attr)

        def wrapper(*args, **kwargs):
            paths = [os.path.relpath(str(a), self.root) for a in args if isinstance(a, (str, os.PathLike))]
            self.reached(f"{attr}({', '.join(paths)})")
            return original(*args, **kwargs)

        setattr(owner, attr, wrapper)

    def install(self) -> None:
        import torch.distributed as dist
        from torch.distributed.checkpoint import FileSystemWriter

        for name in ("rename", "replace", "makedirs", "fsync"):
            self.wrap(os, name)
        self.wrap(shutil, "rmtree")
        self.wrap(FileSystemWriter, "write_data")  # this rank's shard files
        self.wrap(FileSystemWriter, "finish")  # rank 0: DCP's index, .metadata
        self.wrap(dist, "barrier")


def _job(rank: int, init_file: str, root: str, out: str, crash: Optional[Crash], template: Optional[str]) -> None:
    """One rank: resume from `root` if it holds a checkpoint, train to TOTAL_STEPS saving every
    SAVE_EVERY, and write what it saw to `out`/rank{r}.pkl."""
    os.environ["OMP_NUM_THREADS"] = "1"
    import datetime

    import torch.distributed as dist

    from torchpp.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
    from torchpp.models.gpt import GPT, GPTConfig, gpt_loss
    from torchpp.parallel import DistributedOptimizer, init_parallel
    from torchpp.tensor_parallel import model_parallel_manual_seed

    torch.set_num_threads(1)
    start = time.monotonic()
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=45))
    injector = Injector(crash.index if crash is not None and crash.rank == rank else None, root)
    if crash is not None and crash.rank == rank:
        injector.install()
    state = init_parallel(tp=1)
    model_parallel_manual_seed(11, tp_rank=state.tp_rank)
    config = GPTConfig(vocab_size=32, hidden_size=16, num_heads=4, num_layers=2, max_seq_len=8, dropout=0.1)
    model = GPT(config, group=state.tp_group)
    optimizer = DistributedOptimizer(model.parameters(), torch.optim.AdamW, state, zero=True, lr=LR)
    report = dict(rank=rank, resumed=None, previous=None, losses={}, saved={}, caught=[])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = 0
        if latest_checkpoint(root) is not None:
            # The checkpoint before the interrupted one still loads, whatever happened after it.
            previous = load_checkpoint(root, model, optimizer, step=CRASH_STEP - SAVE_EVERY)
            report["previous"] = (previous.step, [p.detach().clone() for p in model.parameters()])
            first = report["resumed"] = load_checkpoint(root, model, optimizer).step
        rows = slice(state.dp_rank * BATCH // state.dp, (state.dp_rank + 1) * BATCH // state.dp)
        for step in range(first, TOTAL_STEPS):
            tokens, labels = _batch(step)
            optimizer.zero_grad()
            loss = gpt_loss(model(tokens[rows]), labels[rows], state.tp_group)
            loss.backward()
            optimizer.step()
            report["losses"][step] = loss.detach().clone()
            if (step + 1) % SAVE_EVERY:
                continue
            injector.armed = step + 1 == CRASH_STEP
            save_checkpoint(root, step + 1, model, optimizer)
            injector.reached("return")  # right after the last operation, before the job goes on
            injector.armed = False
            report["saved"][step + 1] = [p.detach().clone() for p in model.parameters()]
            if template is not None and step + 1 == CRASH_STEP - SAVE_EVERY and rank == 0:
                shutil.copytree(root, template)  # where every crash job starts from
        report["caught"] = [str(w.message) for w in caught]
    report.update(ops=injector.ops[:-1], params=[p.detach().clone() for p in model.parameters()],
                  seconds=time.monotonic() - start)
    with open(os.path.join(out, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()


# ---- the launcher: a fresh job of WORLD ranks, killed as a whole when one rank dies ----
@dataclass
class JobResult:
    exitcodes: List[int]
    reports: List[Optional[dict]]
    seconds: float


_CTX = None


def _context():
    global _CTX
    if _CTX is None:  # a fork server with torch imported once: each job starts in a fraction of a second
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(["torch", "torchpp", "torchpp.checkpoint", "torchpp.models.gpt",
                                     "torchpp.parallel", __name__])
    return _CTX


def run_job(root: str, crash: Optional[Crash] = None, template: Optional[str] = None) -> JobResult:
    ctx = _context()
    with tempfile.TemporaryDirectory(prefix="torchpp_job_") as work:
        procs = [ctx.Process(target=_job, args=(r, os.path.join(work, "store"), root, work, crash, template))
                 for r in range(WORLD)]
        start = time.monotonic()
        for proc in procs:
            proc.start()
        while any(p.exitcode is None for p in procs):
            if time.monotonic() - start > JOB_TIMEOUT_S:
                for proc in procs:
                    proc.kill()
                raise AssertionError(f"job on {root} (crash {crash}) did not end within {JOB_TIMEOUT_S}s (hang)")
            if any(p.exitcode not in (None, 0) for p in procs):  # torchrun's agent stops the whole job
                for proc in procs:
                    if proc.exitcode is None:
                        try:
                            os.kill(proc.pid, signal.SIGKILL)
                        except ProcessLookupError:  # it ended on its own since the check
                            pass
            time.sleep(0.02)
        for proc in procs:
            proc.join()
        seconds = time.monotonic() - start
        reports = []
        for r in range(WORLD):
            path = os.path.join(work, f"rank{r}.pkl")
            reports.append(pickle.load(open(path, "rb")) if os.path.exists(path) else None)
    return JobResult([p.exitcode for p in procs], reports, seconds)


# ---- the cases ----
@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run (its losses and final parameters per rank), the directory as it
    was after the checkpoint before CRASH_STEP, and each rank's file-system operations in the
    save of CRASH_STEP."""
    base = tmp_path_factory.mktemp("reference")
    template = str(base / "template")
    straight = run_job(str(base / "straight"), template=template)
    assert straight.exitcodes == [0] * WORLD, straight
    recorded = []
    for rank in range(WORLD):
        root = str(base / f"record{rank}")
        shutil.copytree(template, root)
        result = run_job(root, Crash(rank, None))
        assert result.exitcodes == [0] * WORLD, result
        recorded.append(result.reports[rank]["ops"])
    return straight, template, recorded


def _assert_restarted(result: JobResult, straight: JobResult, resumed: int, what: str, expect_warning=None):
    assert result.exitcodes == [0] * WORLD, f"{what}: the restarted job failed: {result.exitcodes}"
    for report, want in zip(result.reports, straight.reports):
        label = f"{what}, rank {report['rank']}"
        assert report["resumed"] == resumed, f"{label}: resumed from step {report['resumed']}, expected {resumed}"
        previous_step, previous_params = report["previous"]
        assert previous_step == CRASH_STEP - SAVE_EVERY, label
        assert all(torch.equal(a, b) for a, b in zip(previous_params, want["saved"][previous_step])), \
            f"{label}: the previous checkpoint's parameters"
        losses = torch.stack([report["losses"][s] for s in range(resumed, TOTAL_STEPS)])
        expected = torch.stack([want["losses"][s] for s in range(resumed, TOTAL_STEPS)])
        assert torch.equal(losses, expected), f"{label}: losses {losses.tolist()} != uninterrupted {expected.tolist()}"
        assert all(torch.equal(a, b) for a, b in zip(report["params"], want["params"])), f"{label}: parameters"
        assert report["seconds"] < BOUND_S, f"{label}: the restarted job took {report['seconds']:.1f}s"
        if expect_warning is not None and report["rank"] == 0:  # rank 0 manages the directory and warns
            assert any(expect_warning in text for text in report["caught"]), f"{label}: {report['caught']}"


def _assert_crashed(result: JobResult, crash: Crash, what: str) -> None:
    codes = result.exitcodes
    assert codes[crash.rank] == CRASH_EXIT, f"{what}: the crash point was not reached: exit codes {codes}"
    assert all(code != 0 for code in codes), f"{what}: a rank finished the job: {codes}"
    assert result.seconds < JOB_TIMEOUT_S, what


def _points(recorded):
    """(rank, index, whether the interrupted checkpoint is committed by then) for every point."""
    points = []
    for rank, ops in enumerate(recorded):
        renamed = next((k for k, op in enumerate(ops) if op == f"rename(step_{CRASH_STEP}.tmp, step_{CRASH_STEP})"),
                       None)
        assert (renamed is not None) == (rank == 0), f"rank {rank} operations: {ops}"
        for index in range(len(ops) + 1):
            # Rank 1's last point is after its save returned: rank 0 had finished the commit.
            committed = index > renamed if rank == 0 else index == len(ops)
            points.append((rank, index, committed))
    return points


def test_interrupted_save_at_every_point_resumes_bit_exact(reference, tmp_path):
    straight, template, recorded = reference
    assert len(recorded[0]) >= 8 and len(recorded[1]) >= 2, recorded  # the save really was traced
    for rank, index, committed in _points(recorded):
        ops = recorded[rank]
        what = f"crash on rank {rank} before {ops[index] if index < len(ops) else 'nothing (after the save)'}"
        root = str(tmp_path / f"r{rank}_{index}")
        shutil.copytree(template, root)
        _assert_crashed(run_job(root, Crash(rank, index)), Crash(rank, index), what)
        resumed = CRASH_STEP if committed else CRASH_STEP - SAVE_EVERY
        _assert_restarted(run_job(root), straight, resumed, what)
        assert sorted(os.listdir(root)) == ["latest"] + [f"step_{s}" for s in range(SAVE_EVERY, TOTAL_STEPS + 1,
                                                                                       SAVE_EVERY)], what


def check_clear_errors(root):
    """Asking for a step that does not exist, or for a partial one: the same clear error on every rank."""
    from torchpp.checkpoint import IncompleteCheckpointError, load_checkpoint
    from torchpp.models.gpt import GPT, GPTConfig
    from torchpp.parallel import init_parallel

    state = init_parallel(tp=1)
    model = GPT(GPTConfig(vocab_size=32, hidden_size=16, num_heads=4, num_layers=2, max_seq_len=8),
                group=state.tp_group)
    messages = []
    with pytest.raises(FileNotFoundError) as missing:
        load_checkpoint(root, model, step=3)
    messages.append(str(missing.value))
    with pytest.raises(IncompleteCheckpointError) as partial:
        load_checkpoint(root, model, step=CRASH_STEP)
    messages.append(str(partial.value))
    return messages


def _make_partial(template: str, root: str) -> str:
    """`root`: the template plus a step directory of CRASH_STEP that `latest` does not name,
    with rank 1's data file deleted; returns the deleted file's name."""
    shutil.copytree(template, root)
    shutil.copytree(os.path.join(template, f"step_{CRASH_STEP - SAVE_EVERY}"), os.path.join(root, f"step_{CRASH_STEP}"))
    name = next(n for n in sorted(os.listdir(os.path.join(root, f"step_{CRASH_STEP}"))) if n.startswith("__1_"))
    os.remove(os.path.join(root, f"step_{CRASH_STEP}", name))
    return name


def test_partial_step_directory_is_refused_and_replaced(reference, tmp_path, ranks):
    """A step directory `latest` does not name, with a file missing: loading refuses it (a
    warning naming the file) and resumes from the previous checkpoint; the save of that step
    replaces it, and a crash at every point of that replacing save leaves a job that resumes."""
    straight, template, _ = reference
    root = str(tmp_path / "partial")
    missing = _make_partial(template, root)
    step_dir = f"step_{CRASH_STEP}"
    for message in ranks(WORLD).run(check_clear_errors, root, timeout=JOB_TIMEOUT_S):
        assert f"no checkpoint for step 3 in {root}" in message[0] and "step directories: [2, 4]" in message[0], message
        assert f"{step_dir} is not a complete checkpoint: its file {missing} is missing" in message[1], message
    # Restarted on it: refused with a warning, resumed from the previous step, replaced by its save.
    record = run_job(root, Crash(0, None))
    assert record.exitcodes == [0] * WORLD, record
    _assert_restarted(record, straight, CRASH_STEP - SAVE_EVERY, "partial step directory",
                      expect_warning=f"its file {missing} is missing")
    assert any(f"replacing {os.path.join(root, step_dir)}" in w for w in record.reports[0]["caught"])
    ops = record.reports[0]["ops"]
    renamed = ops.index(f"rename({step_dir}.tmp, {step_dir})")
    assert ops[0] == f"rename({step_dir}, {step_dir}.tmp)", ops  # moved aside, never deleted in place
    for index in range(len(ops) + 1):
        what = f"replacing save, crash on rank 0 before {ops[index] if index < len(ops) else 'nothing'}"
        root = str(tmp_path / f"partial_{index}")
        _make_partial(template, root)
        _assert_crashed(run_job(root, Crash(0, index)), Crash(0, index), what)
        resumed = CRASH_STEP if index > renamed else CRASH_STEP - SAVE_EVERY
        _assert_restarted(run_job(root), straight, resumed, what)
