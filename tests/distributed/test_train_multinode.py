"""The main job launched on two nodes, as docs/training.md shows it: two torchrun agents (here
on one machine) meeting through the c10d rendezvous, 2 ranks each, give the same losses, bit for
bit, as one agent with 4 ranks (pp=2 x tp=2 either way)."""
import uuid

from train_job import SMALL, finish, free_port, last_losses, torchrun

STEPS = 3
JOB_TIMEOUT_S = 300
JOB = SMALL + ["--steps", str(STEPS), "--eval-every", "0", "--checkpoint-dir", "none"]


def test_two_torchrun_agents_train_as_one(tmp_path):
    cache = str(tmp_path / "cache")
    one = str(tmp_path / "one")
    finish(torchrun(["--standalone", "--nproc-per-node", "4"], JOB + ["--out", one], str(tmp_path), cache),
           JOB_TIMEOUT_S)
    endpoint, run_id = f"127.0.0.1:{free_port()}", uuid.uuid4().hex[:8]
    two = str(tmp_path / "two")
    agents = [torchrun(["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
                        "--rdzv-id", run_id], JOB + ["--out", two], str(tmp_path), cache) for _ in range(2)]
    outputs = [finish(agent, JOB_TIMEOUT_S) for agent in agents]
    assert sum("world=4 tp=2 pp=2" in out for out in outputs) == 1, outputs  # one rank 0, on one of the nodes
    expected = last_losses(one)
    assert sorted(expected) == list(range(1, STEPS + 1)), expected
    assert last_losses(two) == expected, (last_losses(two), expected)
