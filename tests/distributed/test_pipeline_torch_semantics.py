"""torch.distributed.pipelining's semantics, which a program migrated by changing imports relies
on, hold for torchpp's classes: ``losses`` cleared and refilled per step, ``loss_fn=None`` as a
forward-only step, eval then train on one schedule object, ``scale_grads=False`` with summed
losses, tracer-built stages keeping the model's parameter names and ``Pipe`` as an
``nn.Module``, schedules of one's own (a ``PipelineScheduleMulti`` subclass, a
``_PipelineScheduleRuntime`` loading a CSV) on the C++ executor, single-stage schedules, the
per-microbatch stage methods, and torch's "fake" test backend. Each compares with one process
(fp64, rtol 1e-10)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

import torch_semantics_checks as checks
from pipeline_checks import config_results, run_configs

TIMEOUT = 240


def _run_each(ranks, world, configs, check):
    return ranks(world).run(run_configs, configs, check, timeout=TIMEOUT)


def test_losses_list_is_cleared_and_refilled_each_step(ranks):
    per_rank = config_results(_run_each(ranks, 2, [{}], checks.losses_refilled_each_step), 0)
    assert per_rank == [1, checks.M]  # rank 0 kept its list as it was


@pytest.mark.parametrize("class_name,kwargs", [("ScheduleGPipe", {}), ("Schedule1F1B", {}),
                                               ("_ScheduleForwardOnly", {"with_loss_fn": True})],
                         ids=["gpipe", "1f1b", "forward_only_class"])
def test_schedule_without_loss_fn_runs_forward_only_and_returns_outputs(ranks, class_name, kwargs):
    config_results(_run_each(ranks, 2, [dict(class_name=class_name, **kwargs)],
                             checks.forward_only_without_loss_fn), 0)


EVAL_THEN_TRAIN = ["ScheduleInterleaved1F1B", "ScheduleLoopedBFS", "ScheduleInterleavedZeroBubble",
                   "ScheduleZBVZeroBubble"]


@pytest.fixture(scope="module")
def eval_then_train(ranks):
    return _run_each(ranks, 2, [dict(class_name=n) for n in EVAL_THEN_TRAIN], checks.eval_then_train_one_object)


@pytest.mark.parametrize("index", range(len(EVAL_THEN_TRAIN)), ids=EVAL_THEN_TRAIN)
def test_eval_then_train_on_one_schedule_object(eval_then_train, index):
    per_rank = config_results(eval_then_train, index)
    assert sorted(s for stages in per_rank for s in stages) == [0, 1, 2, 3]


def test_scale_grads_false_with_a_summed_loss(ranks):
    config_results(_run_each(ranks, 2, [{}], checks.sum_loss_without_scaling), 0)


def test_traced_stages_keep_the_models_parameter_names(ranks):
    per_rank = config_results(_run_each(ranks, 2, [{}], checks.traced_stage_keeps_names), 0)
    assert per_rank[0] == ["layers.0.fc.bias", "layers.0.fc.weight"], per_rank
    assert per_rank[1] == ["layers.1.fc.bias", "layers.1.fc.weight"], per_rank


OWN = ["subclass", "csv", "csv_comms", "comms_attr"]


@pytest.fixture(scope="module")
def own_schedules(ranks):
    return _run_each(ranks, 2, [dict(how=h) for h in OWN], checks.own_schedules)


@pytest.mark.parametrize("index", range(len(OWN)), ids=OWN)
def test_schedule_of_ones_own_runs_on_the_executor(own_schedules, index):
    per_rank = config_results(own_schedules, index)
    assert per_rank[1] == 0 and per_rank[0] > 0  # rank 0 holds the V's first and last stage


SINGLE = ["Schedule1F1B", "ScheduleGPipe", "ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble",
          "ScheduleLoopedBFS"]


@pytest.fixture(scope="module")
def single_stage(ranks):
    return _run_each(ranks, 2, [dict(class_name=n) for n in SINGLE], checks.single_stage_on_one_rank)


@pytest.mark.parametrize("index", range(len(SINGLE)), ids=SINGLE)
def test_single_stage_schedules(single_stage, index):
    assert config_results(single_stage, index) == [2, 2]


def test_per_microbatch_stage_methods_by_hand(ranks):
    config_results(_run_each(ranks, 1, [{}], checks.chunks_by_hand), 0)


FAKE_BACKEND = """
import copy, torch, torch.distributed as dist, torch.nn.functional as F
from torch.testing._internal.distributed.fake_pg import FakeStore
import torchpp.pipeline as pp
dist.init_process_group(backend="fake", rank=0, world_size=1, store=FakeStore())
torch.manual_seed(0)
model = torch.nn.Linear(8, 8).double()
reference = copy.deepcopy(model)
x, y = torch.randn(16, 8, dtype=torch.float64), torch.randn(16, 8, dtype=torch.float64)
sched = pp.{cls}(pp.PipelineStage(model, 0, 1, "cpu"), 2, loss_fn=F.mse_loss)
out = sched.step(x, target=y)
F.mse_loss(reference(x), y).backward()
torch.testing.assert_close(out, reference(x).detach())
torch.testing.assert_close(model.weight.grad, reference.weight.grad)
dist.destroy_process_group()
print("ran on the fake backend")
"""


@pytest.mark.parametrize("cls", ["Schedule1F1B", "ScheduleGPipe"])
def test_torchs_fake_backend_runs_a_single_rank_schedule(cls):
    """torch's tests build schedules over its "fake" process group (no store, no backend
    options); torchpp's executor ran into a segmentation fault there."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", FAKE_BACKEND.format(cls=cls)], capture_output=True, text=True,
                          timeout=TIMEOUT, env=env)
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stderr[-3000:]}"
    assert "ran on the fake backend" in proc.stdout
