"""TorchScript stages run without Python: with every stage module and the loss scripted, the
executor calls them from C++ (no Python forward is entered during a step or an eval) and losses,
gradients and eval outputs equal the single-process run; the same blocks unscripted go through
Python."""
import math

import pytest

from pipeline_checks import assert_no_rank_errors
from script_checks import train_scripted

# (schedule, TorchScript stages, loss scale)
CONFIGS = [("1f1b", True, None), ("zb-h1", True, None), ("interleaved-1f1b", True, None), ("zb-h1", False, None),
           ("zb-h1", True, 2.0**10)]


@pytest.fixture(scope="module")
def results(ranks):
    pool = ranks(2)
    return [pool.run(train_scripted, name, script, scale, timeout=180) for name, script, scale in CONFIGS]


@pytest.mark.parametrize("index", range(len(CONFIGS)), ids=[f"{n}-{'script' if s else 'python'}{'-scaled' if c else ''}" for n, s, c in CONFIGS])
def test_script_stages(results, index):
    name, script, _ = CONFIGS[index]
    per_rank = results[index]
    assert_no_rank_errors(per_rank)
    for r in per_rank:
        assert r["torchscript_stages"] is script
        if script:
            assert r["python_calls"] == [], f"Python entered during a TorchScript step: {r['python_calls']}"
        else:  # the control: the same check sees Python stages
            assert any("Block.forward" in c for c in r["python_calls"]), r["python_calls"]
    for step in range(2):
        losses = [r["steps"][step]["loss"] for r in per_rank if r["steps"][step]["loss"] is not None]
        assert len(losses) == 1
        assert math.isclose(losses[0], per_rank[0]["steps"][step]["ref_loss"], rel_tol=1e-10)
    eval_losses = [r["eval_loss"] for r in per_rank if r["eval_loss"] is not None]
    assert len(eval_losses) == 1
    assert math.isclose(eval_losses[0], per_rank[0]["eval_ref_loss"], rel_tol=1e-10)
