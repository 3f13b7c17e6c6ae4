"""The main job on the GPU, as a user first meets torchpp there: examples/train_llama.py under
torchrun, pp=2 on two ranks sharing the one GPU (``-m torchpp.testing.one_gpu`` gives each its
NCCL host id), bf16 autocast, real text. Trained to step 20, checkpointing every 10 steps: the
loss falls and the held-out loss is written. Started again to step 30 on the same folder, it
resumes from its step-20 checkpoint (DCP over NCCL) and goes on from step 21 with the trained
weights (not near step 1's loss), its held-out loss at step 30 far below step 0's."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMEOUT_S = 150


def _train(out: str, steps: int) -> list:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "torchpp.testing.one_gpu", "examples/train_llama.py", "--tp", "1", "--pp", "2", "--bf16",
               "--steps", str(steps), "--eval-every", "0", "--checkpoint-every", "10", "--out", out,
               "--checkpoint-dir", os.path.join(out, "checkpoints"), "--tensorboard", "none"]
    env = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, f"the job failed (exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    with open(os.path.join(out, "metrics.jsonl")) as rows:
        return [json.loads(row) for row in rows], done.stdout


def test_train_llama_on_the_gpu_falls_and_resumes(tmp_path):
    out = str(tmp_path / "llama")
    rows, _ = _train(out, 20)
    losses = {row["step"]: row["loss"] for row in rows if "loss" in row}
    assert sorted(losses) == list(range(1, 21)), sorted(losses)
    assert losses[20] < losses[1] - 0.5, f"the loss did not fall: {losses[1]:.3f} at step 1, {losses[20]:.3f} at 20"
    assert any("eval_loss" in row and row["step"] == 20 for row in rows), "no held-out loss at the last step"
    rows, stdout = _train(out, 30)
    assert "resumed from" in stdout and "at step 20" in stdout, stdout[-2000:]
    resumed = [row["step"] for row in rows if "loss" in row][20:]
    assert resumed == list(range(21, 31)), f"the resumed run logged steps {resumed}, not 21-30"
    later = {row["step"]: row["loss"] for row in rows if "loss" in row}
    # A resume that lost the weights would start again near step 1's loss (the step-1 model is untrained).
    assert later[21] < losses[1] - 0.5, f"step 21 after the resume: {later[21]:.3f}, step 1: {losses[1]:.3f}"
    evals = {row["step"]: row["eval_loss"] for row in rows if "eval_loss" in row}
    assert evals[30] < evals[0] - 1.0, f"held-out loss {evals[0]:.3f} at step 0, {evals[30]:.3f} at step 30"
