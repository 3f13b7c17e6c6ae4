"""The runnable programs of docs/ and examples/ run as written, under torchrun on CPU ranks.

Each program is cut out of its page as the page presents it (the fenced block a sentence tells
the reader to save and run), so an API change that breaks a page fails here.
"""
import json
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUN_TIMEOUT_S = 300
LOSS = re.compile(r"step\s+(\d+)\D.*?loss\s+([0-9.]+)")


def python_block(page: str, needle: str) -> str:
    """The first ```python block of docs/`page` that contains `needle` or follows it within
    the same section."""
    text = open(os.path.join(ROOT, "docs", page)).read()
    for match in re.finditer(r"```python\n(.*?)```", text, re.S):
        section_start = text.rfind("\n#", 0, match.start())
        if needle in match.group(1) or needle in text[section_start:match.start()]:
            return match.group(1)
    raise AssertionError(f"docs/{page} has no python block for {needle!r}")


def run(args, cwd, nproc=None):
    """Runs a program (under torchrun when nproc is given); returns its stdout. A run past the
    timeout is killed with every rank it started and fails the test."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    command = (launcher if nproc else [sys.executable]) + args
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1")
    proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"{' '.join(args)} did not finish within {RUN_TIMEOUT_S}s")
    assert proc.returncode == 0, f"{' '.join(args)} exited with {proc.returncode}:\n{err[-4000:]}"
    return out


def losses(output: str):
    """{step: loss} from lines like 'step 3 loss 1.0338' (any spacing, other fields between)."""
    return {int(m.group(1)): float(m.group(2)) for m in map(LOSS.search, output.splitlines()) if m}


def test_pipeline_page_example_trains(tmp_path):
    (tmp_path / "pp_example.py").write_text(python_block("pipeline.md", "Save as `pp_example.py`"))
    output = run(["pp_example.py"], tmp_path, nproc=2)
    found = losses(output)
    assert sorted(found) == list(range(5)), found
    assert all(found[s + 1] < found[s] for s in range(4)), found
    assert re.search(r"validation loss [0-9.]+, outputs \(16, 4\)", output), output


def test_pipeline_page_traced_example_trains(tmp_path):
    """torch's tracing frontend, and a skip across stages that torch's own runtime rejects."""
    (tmp_path / "traced.py").write_text(python_block("pipeline.md", "Save as `traced.py`"))
    found = losses(run(["traced.py"], tmp_path, nproc=2))
    assert sorted(found) == list(range(5)), found
    assert all(found[s + 1] < found[s] for s in range(4)), found


def test_ptdp_page_example_prints_the_documented_losses(tmp_path):
    """The page shows the program's output; the run reproduces it (fixed seeds, CPU)."""
    (tmp_path / "hf_ptdp.py").write_text(python_block("ptdp.md", "Save as `hf_ptdp.py`"))
    found = losses(run(["hf_ptdp.py"], tmp_path, nproc=4))
    page = open(os.path.join(ROOT, "docs", "ptdp.md")).read()
    shown = page[page.index("Output (the loss falls)"):]
    documented = losses(shown[:shown.index("```", shown.index("```") + 3)])
    assert sorted(found) == sorted(documented) == list(range(0, 30, 5)), (found, documented)
    for step, loss in documented.items():
        assert found[step] == pytest.approx(loss, abs=2e-3), (step, found[step], loss)


def test_ptdp_page_auto_plan_example_keeps_the_mixer_whole(tmp_path):
    (tmp_path / "auto_plan.py").write_text(python_block("ptdp.md", "Save as `auto_plan.py`"))
    output = run(["auto_plan.py"], tmp_path)
    assert "model.layers.{0,1}.conv.out_proj: kept whole (with its readers conv.in_proj: split over tp=2 it fails" \
        in output, output
    assert "linears split per layer: Lfm3DecoderLayer 3-8/8" in output, output
    assert "linears split per layer: BambaDecoderLayer 5/5" in output, output
    assert "linears split per layer: JambaMambaDecoderLayer 5-7/7" in output, output  # experts counted
    assert "linears split per layer: BloomBlock 4/4" in output, output
    assert "linears split per layer: OlmoeDecoderLayer 5/5" in output, output  # its experts too


def test_ptdp_page_user_plan_example_trains(tmp_path):
    (tmp_path / "user_plan.py").write_text(python_block("ptdp.md", "Save as `user_plan.py`"))
    found = losses(run(["user_plan.py"], tmp_path, nproc=4))
    assert sorted(found) == [0, 5, 10, 15], found
    assert found[15] < found[0] - 0.5, f"the user's model does not learn: {found}"


def test_ptdp_page_checkpoint_example_reloads_what_it_trained(tmp_path):
    (tmp_path / "hf_weights.py").write_text(python_block("ptdp.md", "Save as `hf_weights.py`"))
    output = run(["hf_weights.py"], tmp_path, nproc=4)
    pipeline = re.search(r"pipeline loss ([0-9.]+)", output)
    reloaded = re.search(r"from_pretrained loss ([0-9.]+)", output)
    assert pipeline and reloaded, output
    assert float(reloaded.group(1)) == pytest.approx(float(pipeline.group(1)), rel=1e-5), output
    assert float(pipeline.group(1)) < 4.0, output  # trained: log(64) = 4.16 at the start
    assert sorted(os.listdir(tmp_path / "tuned")) == [
        "config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
        "model.safetensors.index.json"]


def test_ptdp_page_zero_stages_example(tmp_path):
    """The four ZeRO stages train to the same loss; each holds what the page's table says."""
    (tmp_path / "zero_stages.py").write_text(python_block("ptdp.md", "Save as `zero_stages.py`"))
    pattern = re.compile(r"zero=(\d) loss ([0-9.]+) bytes param (\d+) grad (\d+) optimizer (\d+)")
    found = {int(m[0]): (float(m[1]), *map(int, m[2:])) for m in pattern.findall(run(["zero_stages.py"], tmp_path, nproc=2))}
    page = open(os.path.join(ROOT, "docs", "ptdp.md")).read()
    documented = {int(m[0]): (float(m[1]), *map(int, m[2:])) for m in pattern.findall(page)}
    assert sorted(found) == sorted(documented) == [0, 1, 2, 3], (found, documented)
    for zero, (loss, param, grad, optimizer) in found.items():
        assert loss == pytest.approx(found[0][0], rel=1e-5) and loss == pytest.approx(documented[zero][0], abs=1e-4)
        assert (param, grad, optimizer) == documented[zero][1:], (zero, found[zero], documented[zero])
    full_param, full_grad, full_optimizer = found[0][1:]
    assert found[1][3] * 2 == full_optimizer and found[2][2] * 2 == full_grad and found[3][1] * 2 == full_param


def test_megatron_page_example_matches_megatrons_schedule():
    script = os.path.join(ROOT, "megatron_zb_doc_example.py")  # run from the root: it imports the test shim
    with open(script, "w") as f:
        f.write(python_block("megatron.md", "`megatron_zb.py`"))
    try:
        out = run([script], ROOT, nproc=4)
    finally:
        os.remove(script)
    lines = {line.split(" losses ")[0].strip(): line.split(" losses ")[1] for line in out.splitlines() if " losses " in line}
    assert set(lines) == {"megatron 1f1b", "torchpp zb-h1"}, out
    assert lines["megatron 1f1b"] == lines["torchpp zb-h1"], lines


def test_context_parallel_page_example_equals_sdpa(tmp_path):
    (tmp_path / "cp_attention.py").write_text(python_block("context_parallel.md", "`cp_attention.py`"))
    out = run(["cp_attention.py", "all-to-all+ring"], tmp_path, nproc=4)  # (the ring inside: the ops' tests)
    errors = [float(x) for x in re.findall(r"(?:output|dq|dk|dv) ([0-9.e+-]+)", out)]
    assert len(errors) == 4 and max(errors) < 1e-10, out


def test_context_parallel_page_model_example_prints_the_documented_losses(tmp_path):
    """A Llama at pp=2 x cp=2 on packed rows: the first loss is the unwrapped model's, and the
    run reproduces the page's output."""
    (tmp_path / "cp_llama.py").write_text(python_block("context_parallel.md", "`cp_llama.py`"))
    out = run(["cp_llama.py"], tmp_path, nproc=4)
    first = re.search(r"step 0 loss ([0-9.]+) \(unwrapped model: ([0-9.]+)\)", out)
    assert first and first.group(1) == first.group(2), out
    found = losses(out)
    assert sorted(found) == list(range(6)) and all(found[s + 1] < found[s] for s in range(5)), found
    page = open(os.path.join(ROOT, "docs", "context_parallel.md")).read()
    shown = page[page.index("step 0 loss", page.index("`cp_llama.py`")):]
    assert losses(shown[:shown.index("```")]) == found, out


def test_tensor_parallel_page_example_runs(tmp_path):
    (tmp_path / "this.py").write_text(python_block("tensor_parallel.md", "torchrun --nproc-per-node 2 this.py"))
    run(["this.py"], tmp_path, nproc=2)


def test_reliability_page_example_skips_then_raises(tmp_path):
    """docs/reliability.md: a NaN gradient on rank 0 from step 2 on; both ranks skip steps 2
    and 3 and stop at step 4 with the error naming the parameter and rank."""
    (tmp_path / "nan_guard.py").write_text(python_block("reliability.md", "nan_guard.py"))
    output = run(["nan_guard.py"], tmp_path, nproc=2)
    for rank in (0, 1):
        skipped = re.findall(rf"rank {rank} step (\d) norm \S+ skipped (True|False)", output)
        assert skipped == [("0", "False"), ("1", "False"), ("2", "True"), ("3", "True")], output[-3000:]
        stop = re.search(rf"rank {rank} step 4 stopped: .*not finite for 3 consecutive steps.*"
                         r"first in 'model.embed_tokens.weight' on global rank 0", output)
        assert stop, output[-3000:]


def test_schedules_page_example_runs(tmp_path):
    (tmp_path / "schedules.py").write_text(python_block("schedules.md", "S.generate(\"zb-h1\""))
    run(["schedules.py"], tmp_path)
    for name in ("zb-h1.csv", "zb-h1.json", "zb-h1.png"):
        assert (tmp_path / name).stat().st_size > 0, name


def test_schedules_page_controllable_memory_example_prints_its_numbers(tmp_path):
    (tmp_path / "v_schedules.py").write_text(python_block("schedules.md", "S.generate(name, p, m), weight_pending=1.0"))
    assert run(["v_schedules.py"], tmp_path).split() == ["v-min", "8.0", "0.153", "v-half", "10.0", "0.138",
                                                          "zb-v", "23.0", "0.007", "159.0"]


def _assert_trained_with_trace(output: str, out, steps: int, llama: bool) -> None:
    found = losses(output)
    assert sorted(found) == list(range(1, steps + 1)), output[-2000:]
    assert found[steps] < found[1], found
    trace = json.loads((out / "trace.json").read_text())
    assert {event["pid"] for event in trace["traceEvents"]} == {0, 1, 2, 3}  # every rank's timeline, one file
    assert (out / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if llama:  # the measured bubble next to the simulator's from the measured costs
        assert re.search(r"measured bubble ratio \(last step\) [\d.]+; simulator from the measured per-stage "
                         r"costs [\d.]+ \(ms per stage: F [\d.]+ I [\d.]+ W [\d.]+", output), output[-2000:]
        assert "\r" not in output, output[-2000:]  # no bar redrawn over the step lines in a log


def test_example_trains_and_writes_its_trace(tmp_path):
    """A GPT, pp=2 x tp=2, zb-h1 (the README's demo, a Llama, is checked alike below)."""
    out = tmp_path / "run"
    output = run([os.path.join(ROOT, "examples", "train_ptdp.py"), "--steps", "4", "--out", str(out)], tmp_path,
                 nproc=4)
    _assert_trained_with_trace(output, out, 4, llama=False)


def test_llama_demo_trains_writes_its_trace_and_a_checkpoint_it_can_start_from(tmp_path):
    """The README's demo (a tiny Llama, pp=2 x tp=2, zb-h1) trains and writes its trace, timeline
    and measured bubble; --save-hf writes what --init-from (a meta-device model, each rank loading
    its shards; here at another layout, pp=2 on 2 ranks) starts from: the fine-tune's first loss is
    the trained model's, below the random start's."""
    saved = tmp_path / "hf"
    first = run([os.path.join(ROOT, "examples", "train_llama.py"), "--steps", "6", "--save-hf", str(saved),
                 "--out", str(tmp_path / "a")], tmp_path, nproc=4)
    _assert_trained_with_trace(first, tmp_path / "a", 6, llama=True)
    assert (saved / "config.json").is_file() and (saved / "model.safetensors.index.json").is_file()
    second = run([os.path.join(ROOT, "examples", "train_llama.py"), "--steps", "1", "--init-from", str(saved),
                  "--tp", "1", "--out", str(tmp_path / "b")], tmp_path, nproc=2)
    before, after = losses(first), losses(second)
    assert sorted(before) == list(range(1, 7)) and sorted(after) == [1], (first[-2000:], second[-2000:])
    assert after[1] < before[1] - 0.1, (before, after)  # the same first batch, seen by a trained model


@pytest.fixture(scope="module")
def fp16_demo_output(tmp_path_factory):
    out = tmp_path_factory.mktemp("fp16")
    # pp=2 on 2 ranks (post-validation and loss scaling at pp2 x tp2: tests/distributed/test_post_validation.py)
    return run([os.path.join(ROOT, "examples", "train_llama.py"), "--fp16", "--tp", "1", "--steps", "4", "--out",
                str(out)], out, nproc=2)


def test_llama_demo_trains_under_fp16_loss_scaling(fp16_demo_output):
    found = losses(fp16_demo_output)
    assert sorted(found) == [1, 2, 3, 4] and found[4] < found[1], fp16_demo_output[-2000:]
    scales = re.findall(r"loss-scale (\d+)", fp16_demo_output)
    assert len(scales) == 4 and all(float(s) >= 1 for s in scales), fp16_demo_output[-2000:]


def test_llama_demo_post_validated_trains_as_the_synchronous_run(tmp_path, fp16_demo_output):
    output = run([os.path.join(ROOT, "examples", "train_llama.py"), "--fp16", "--post-validate", "--tp", "1", "--steps",
                  "4", "--out", str(tmp_path / "run")], tmp_path, nproc=2)
    # Its gradients clip at every step, so every batch after the first runs twice, and the
    # printed losses are the synchronous run's.
    assert losses(output) == losses(fp16_demo_output), output[-2000:]
    assert re.findall(r"re-runs (\d+)", output) == ["0", "1", "2", "3"], output[-2000:]


def test_llama_demo_with_context_parallelism_trains_as_without(tmp_path):
    """--cp 2: every sequence split over two ranks (pp=2 x cp=2 on 4 ranks; all-to-all attention,
    the ring being the default every other cp test runs) prints the losses of the same run at cp=1
    (pp=2 on 2 ranks), to the printed digits (fp32 sums in another order may round the last one
    the other way)."""
    demo = os.path.join(ROOT, "examples", "train_llama.py")
    split = run([demo, "--tp", "1", "--pp", "2", "--cp", "2", "--cp-mode", "all-to-all", "--steps", "3", "--out",
                 str(tmp_path / "cp")], tmp_path, nproc=4)
    whole = run([demo, "--tp", "1", "--pp", "2", "--steps", "3", "--out", str(tmp_path / "whole")], tmp_path, nproc=2)
    assert "cp=2" in split and sorted(losses(split)) == [1, 2, 3], split[-2000:]
    assert sorted(losses(whole)) == [1, 2, 3], whole[-2000:]
    for step, loss in losses(split).items():
        assert abs(loss - losses(whole)[step]) <= 1.5e-4, (split[-2000:], whole[-2000:])


def test_expert_parallel_page_example_trains(tmp_path):
    (tmp_path / "ep_mixtral.py").write_text(python_block("expert_parallel.md", "`ep_mixtral.py`"))
    output = run(["ep_mixtral.py"], tmp_path, nproc=2)
    assert output.count("experts 2 of 4") == 2, output
    found = losses(output)
    assert sorted(found) == list(range(5)) and found[4] < found[0], found


# ---- docs/training.md: the main job's data, checkpoints and resume ----
def test_training_page_loop_resumes_from_its_checkpoint(tmp_path):
    """train_text.py 4 saves steps 2 and 4; train_text.py 6 resumes at 4 by itself and trains 5 and 6."""
    (tmp_path / "train_text.py").write_text(python_block("training.md", "train_text.py"))
    first = run(["train_text.py", "4"], tmp_path, nproc=2)
    assert sorted(losses(first)) == [1, 2, 3, 4] and "resumed" not in first, first[-2000:]
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step_4"
    second = run(["train_text.py", "6"], tmp_path, nproc=2)
    assert "resumed at step 4" in second and sorted(losses(second)) == [5, 6], second[-2000:]


def test_llama_demo_resumes_and_reads_local_data_and_tokenizer(tmp_path):
    """The demo started again on a checkpoint directory resumes by itself: a run's directory as a
    crash after step 2 would leave it (step_3 gone, latest naming step_2) gives step 3's loss bit
    for bit; --data reads a .jsonl file, --tokenizer the tokenizer --save-hf wrote."""
    demo = os.path.join(ROOT, "examples", "train_llama.py")
    small = ["--hidden", "32", "--ffn", "64", "--layers", "2", "--seq", "32", "--batch", "8", "--eval-every", "2",
             "--steps", "3", "--checkpoint-every", "2"]
    whole = run([demo, *small, "--out", str(tmp_path / "whole"), "--save-hf", str(tmp_path / "hf")], tmp_path, nproc=4)
    assert re.search(r"held-out loss [\d.]+ at step 2", whole), whole[-2000:]
    assert (tmp_path / "whole" / "loss.png").read_bytes()[:4] == b"\x89PNG"
    assert any((tmp_path / "whole" / "tensorboard").iterdir())
    shutil.copytree(tmp_path / "whole" / "checkpoints", tmp_path / "resumed" / "checkpoints")
    shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "step_3")
    (tmp_path / "resumed" / "checkpoints" / "latest").write_text("step_2\n")
    again = run([demo, *small, "--out", str(tmp_path / "resumed")], tmp_path, nproc=4)
    assert "at step 2 (model, optimizer, LR schedule, data position" in again, again[-2000:]
    assert sorted(losses(again)) == [3], again[-2000:]
    exact, resumed = ({r["step"]: r for r in map(json.loads, (tmp_path / name / "metrics.jsonl").read_text().splitlines())}
                      for name in ("whole", "resumed"))
    assert sorted(resumed) == [3] and sorted(exact) == [0, 1, 2, 3], (resumed, exact)
    assert resumed[3]["loss"] == exact[3]["loss"] and resumed[3]["eval_loss"] == exact[3]["eval_loss"], \
        (resumed, exact)  # bit for bit
    (tmp_path / "texts.jsonl").write_text("".join(json.dumps({"text": f"Document {i}: " + "words and more words. " * 60})
                                                  + "\n" for i in range(40)))
    own = run([demo, *small, "--data", "texts.jsonl", "--tokenizer", str(tmp_path / "hf"), "--checkpoint-dir", "none",
               "--tp", "1", "--out", str(tmp_path / "own")], tmp_path, nproc=2)  # (the layout is not what it checks)
    assert "text: texts.jsonl, 40 documents; the tokenizer in" in own and sorted(losses(own)) == [1, 2, 3], \
        own[-2000:]


MIGRATION = re.compile(r"step (\d+) loss ([0-9.]+) grad_norm ([0-9.]+)")


@pytest.mark.parametrize("schedule,frontend", [("1F1B", "manual"), ("Interleaved1F1B", "tracer"),
                                               ("ZBVZeroBubble", "manual")])
def test_migrating_page_loop_gives_torchs_losses_and_gradients(tmp_path, schedule, frontend):
    """docs/migrating.md: the torchtitan-style loop as written (torch) and with its imports
    changed to torchpp.pipeline prints the same loss and gradient norm at every step."""
    if schedule == "ZBVZeroBubble" and torch.__version__ < "2.13":
        pytest.skip(f"torch {torch.__version__}'s own ZB-V fails over gloo at its stages' first exchange (a rank "
                    f"holding two adjacent stages: 'Pair is not connected'); torchpp's ZB-V is checked against one "
                    f"process in test_pipeline_torch_names")
    program = python_block("migrating.md", "`titan_loop.py`")
    migrated = program.replace("from torch.distributed.pipelining", "from torchpp.pipeline")
    assert migrated.count("torchpp.pipeline") == 2 and "torch.distributed.pipelining" not in migrated
    results = {}
    for name, text in (("torch", program), ("torchpp", migrated)):
        (tmp_path / f"loop_{name}.py").write_text(text)  # not torch.py: it would shadow the package
        out = run([f"loop_{name}.py", schedule, frontend], tmp_path, nproc=2)
        results[name] = {int(s): (float(loss), float(norm)) for s, loss, norm in MIGRATION.findall(out)}
    assert sorted(results["torch"]) == list(range(4)), results
    assert results["torchpp"].keys() == results["torch"].keys(), results
    for step, (loss, norm) in results["torch"].items():
        assert results["torchpp"][step] == pytest.approx((loss, norm), rel=1e-9), (step, results)
    assert results["torch"][3][0] < results["torch"][0][0]  # it trains
