"""Fault suite, the main job under `torchrun --max-restarts`: a rank SIGKILLed at a random step.

examples/train_llama.py runs at pp=2 x tp=2 on 4 CPU ranks (a small Llama, the default text),
checkpointing every SAVE_EVERY steps in the background. Once it has logged a step drawn at
random, the test SIGKILLs one of its ranks, also drawn at random. torchrun's agent stops the
others and starts the job again; the job finds the latest complete checkpoint by itself,
resumes there (model, optimizer, LR schedule, data position, RNG), and every loss it logs from
there on, and the held-out loss, equals bit for bit (float ==) the uninterrupted run's.
"""
import os
import random
import re
import signal

from train_job import SMALL, finish, last_losses, metrics, torchrun, wait_for_step, worker_pids

STEPS, SAVE_EVERY, EVAL_EVERY = 12, 3, 5
JOB_TIMEOUT_S = 420  # two starts of 4 ranks (imports, tokenizer) and the steps, on a loaded 2-core machine
JOB = SMALL + ["--steps", str(STEPS), "--checkpoint-every", str(SAVE_EVERY), "--eval-every", str(EVAL_EVERY)]


def test_a_killed_rank_costs_nothing_after_torchrun_restarts_the_job(tmp_path):
    cache = str(tmp_path / "cache")
    uninterrupted = str(tmp_path / "uninterrupted")
    finish(torchrun(["--standalone", "--nproc-per-node", "4"], JOB + ["--out", uninterrupted], str(tmp_path), cache),
           JOB_TIMEOUT_S, "the uninterrupted job")
    expected, expected_eval = last_losses(uninterrupted), last_losses(uninterrupted, "eval_loss")
    assert sorted(expected) == list(range(1, STEPS + 1)) and sorted(expected_eval) == [0, 5, 10, 12], expected_eval

    draw = random.Random()
    seed = draw.randrange(1 << 30)
    draw.seed(seed)
    # By the time step 2 * SAVE_EVERY is logged, the save of step SAVE_EVERY is committed (each
    # save waits for the one before); steps are left after the kill.
    kill_after = draw.randint(2 * SAVE_EVERY, STEPS - 3)
    killed_dir = str(tmp_path / "killed")
    job = torchrun(["--standalone", "--nproc-per-node", "4", "--max-restarts", "1", "--monitor-interval", "0.1"],
                   JOB + ["--out", killed_dir], str(tmp_path), cache)
    wait_for_step(killed_dir, kill_after, job, JOB_TIMEOUT_S)
    ranks = worker_pids(job.pid)
    assert len(ranks) == 4, ranks
    victim = draw.choice(ranks)
    os.kill(victim, signal.SIGKILL)
    what = f"(seed {seed}: SIGKILL to pid {victim} after step {kill_after} was logged)"
    output = finish(job, JOB_TIMEOUT_S, f"the killed job {what}")

    resumed = [int(s) for s in re.findall(r"resumed from \S+ at step (\d+)", output)]
    assert len(resumed) == 1 and resumed[0] % SAVE_EVERY == 0 and SAVE_EVERY <= resumed[0] < STEPS, \
        f"{what} {resumed}\n{output[-4000:]}"
    steps = [r["step"] for r in metrics(killed_dir) if "loss" in r]
    assert steps[:kill_after] == list(range(1, kill_after + 1)), f"{what}: steps logged {steps}"  # the first start
    assert steps[-(STEPS - resumed[0]):] == list(range(resumed[0] + 1, STEPS + 1)), f"{what}: steps logged {steps}"
    got, got_eval = last_losses(killed_dir), last_losses(killed_dir, "eval_loss")
    after = {s: got[s] for s in range(resumed[0] + 1, STEPS + 1)}
    assert after == {s: expected[s] for s in after}, f"{what}: losses after the restart {after} != {expected}"
    assert got_eval == expected_eval, f"{what}: held-out losses {got_eval} != {expected_eval}"
