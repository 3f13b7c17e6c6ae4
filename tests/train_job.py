"""The main job (examples/train_llama.py) launched as a user would, under torchrun, for the
tests of its restarts and multi-node launches: small settings, every process killed on timeout."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "train_llama.py")
# A 2-layer Llama at pp=2 x tp=2 on short rows: a step takes well under a second here.
SMALL = ["--hidden", "32", "--ffn", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--seq", "32",
         "--batch", "8", "--vocab-size", "1024", "--eval-batches", "1", "--warmup", "2", "--tensorboard", "none"]


def env(cache: str) -> Dict[str, str]:
    """The job's environment: one thread per rank (bit-identical sums), a private tokenizer cache,
    and torchrun's workers on a store of their own per attempt (docs/training.md, "Restarts")."""
    return dict(os.environ, OMP_NUM_THREADS="1", TORCHPP_CACHE=cache, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
                PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))


def torchrun(launcher_args: List[str], job_args: List[str], cwd: str, cache: str) -> subprocess.Popen:
    """Starts `torchrun <launcher_args> train_llama.py <job_args>` in its own process group."""
    command = [sys.executable, "-m", "torch.distributed.run", *launcher_args, SCRIPT, *job_args]
    return subprocess.Popen(command, cwd=cwd, env=env(cache), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float, what: str = "the job") -> str:
    """Its output once it exits; past `timeout` every process it started is killed and this raises."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"{what} did not finish within {timeout}s:\n{out[-3000:]}")
    assert proc.returncode == 0, f"{what} failed ({proc.returncode}):\n{out[-8000:]}"
    return out


def metrics(out_dir: str) -> List[dict]:
    """Every record of the job's metrics.jsonl, in the order written (a restarted job appends)."""
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def last_losses(out_dir: str, key: str = "loss") -> Dict[int, float]:
    """{step: the last value written for it}: exact floats, as the job computed them."""
    return {r["step"]: r[key] for r in metrics(out_dir) if key in r}


def wait_for_step(out_dir: str, step: int, proc: subprocess.Popen, timeout: float) -> None:
    """Waits until the job has logged `step` (raises if it exits or times out first)."""
    path, deadline = os.path.join(out_dir, "metrics.jsonl"), time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(path) and any(r["step"] >= step for r in metrics(out_dir)):
            return
        if proc.poll() is not None:
            raise AssertionError(f"the job exited ({proc.returncode}) before step {step}:\n{proc.stdout.read()[-3000:]}")
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    raise AssertionError(f"the job did not reach step {step} within {timeout}s")


def worker_pids(agent_pid: int) -> List[int]:
    """The ranks torchrun's agent started (its child processes, from /proc)."""
    children = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:  # exited meanwhile
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == agent_pid:  # the field after the state: ppid
                children.append(int(entry))
    return sorted(children)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


__all__ = ["SMALL", "finish", "free_port", "last_losses", "metrics", "torchrun", "wait_for_step", "worker_pids"]
