"""PipelineSchedule.eval (forward only, as torch.distributed.pipelining's eval) for every
schedule on p=2, and on p=4 for one schedule of each placement, tagged and in order: outputs
and losses equal the single-process forward, gradients are untouched, and eval steps mix with
training steps and with a changing sequence length.
"""
import math

import pytest
import torch

from pipeline_checks import config_results, eval_and_compare, run_configs
from torchpp import schedule as S

CONFIGS = {
    2: [dict(name=name) for name in S.SCHEDULES] + [dict(name="zb-v", in_order_p2p=True),
                                                     dict(name="dualpipe", in_order_p2p=True),
                                                     dict(name="1f1b", dtype=torch.float32, m=5)],
    4: [dict(name=name) for name in ("1f1b", "interleaved-1f1b", "zb-v", "dualpipe")]
       + [dict(name="interleaved-1f1b", in_order_p2p=True)],
}


def _label(config):
    return config["name"] + "".join(f"-{k}={v}" for k, v in config.items() if k != "name").replace("torch.", "")


@pytest.fixture(scope="module")
def results(ranks):
    return {p: ranks(p).run(run_configs, configs, eval_and_compare, timeout=300) for p, configs in CONFIGS.items()}


CASES = [(p, k) for p, configs in CONFIGS.items() for k in range(len(configs))]


@pytest.mark.parametrize("p, index", CASES, ids=[f"p{p}-{_label(CONFIGS[p][k])}" for p, k in CASES])
def test_eval_matches_reference_forward(results, p, index):
    config = CONFIGS[p][index]
    per_rank = config_results(results[p], index)
    rtol = 1e-10 if config.get("dtype", torch.float64) is torch.float64 else 1e-5
    evals_with_target = len(per_rank[0]["shares"])
    assert evals_with_target == 2
    for k in range(evals_with_target):
        total = sum(r["shares"][k][0] for r in per_rank)
        reference = per_rank[0]["shares"][k][1]
        assert math.isclose(total, reference, rel_tol=rtol), (config, k, total, reference)
