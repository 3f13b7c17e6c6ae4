"""Every schedule of the compiler trains TinyLM on p=2 and p=4 gloo ranks for two optimizer
steps with losses and all gradients equal to the single-process reference, with tagged messages
(gloo's default) and in order (NCCL's way: one tag, so gloo too matches by order and a lowering
whose two ranks disagree on the order would cross tensors).

All schedule runs of one world size share one pool run (the machine has 2 cores); each
schedule then gets its own test that reads the cached result.
"""
import math

import pytest
import torch

from pipeline_checks import config_results, run_configs
from torchpp import schedule as S

WORLD_SIZES = (2, 4)
PEAK_SCHEDULES = ("1f1b", "zb-h1", "zb-h2", "v-half", "v-min")


def _configs():
    configs = [dict(name=name) for name in S.SCHEDULES]
    configs += [dict(name=name, dtype=torch.float32) for name in S.SCHEDULES]
    # Uneven microbatches (16 rows into 6: sizes 3,3,3,3,2,2) and a sequence length that changes
    # between steps (shapes are re-exchanged), stays, and changes back; DualPipe has two ranks
    # that see step inputs.
    configs += [dict(name="zb-h1", m=6, batch=16, seq_lens=(6, 4, 4, 6)), dict(name="interleaved-1f1b", seq_lens=(5, 7)),
                dict(name="dualpipe", seq_lens=(6, 4, 4))]
    configs += [dict(name=name, in_order_p2p=True) for name in S.SCHEDULES]
    configs += [dict(name="zb-h1", m=6, batch=16, seq_lens=(6, 4, 4, 6), in_order_p2p=True),
                dict(name="dualpipe", seq_lens=(6, 4, 4), in_order_p2p=True)]
    return configs


CONFIGS = _configs()


def _label(config):
    extra = [k for k in ("dtype", "m", "seq_lens", "in_order_p2p") if k in config]
    return config["name"] + "".join(f"-{k}={config[k]}" for k in extra).replace("torch.", "")


@pytest.fixture(scope="module")
def results(ranks):
    return {p: ranks(p).run(run_configs, CONFIGS, timeout=300) for p in WORLD_SIZES}


@pytest.mark.parametrize("p", WORLD_SIZES)
@pytest.mark.parametrize("index", range(len(CONFIGS)), ids=[_label(c) for c in CONFIGS])
def test_schedule_matches_reference(results, p, index):
    config = CONFIGS[index]
    per_rank = config_results(results[p], index)
    rtol = 1e-10 if config.get("dtype", torch.float64) is torch.float64 else 1e-5
    for step in range(len(per_rank[0]["steps"])):
        total = sum(r["steps"][step]["loss_share"] for r in per_rank)
        ref = per_rank[0]["steps"][step]["ref_loss"]
        assert any(r["steps"][step]["has_loss"] for r in per_rank)
        assert math.isclose(total, ref, rel_tol=rtol), (config, step, total, ref)


@pytest.mark.parametrize("p", WORLD_SIZES)
@pytest.mark.parametrize("name", PEAK_SCHEDULES)
def test_peak_activations_match_simulator(results, p, name):
    index = next(k for k, c in enumerate(CONFIGS) if c == dict(name=name))
    measured = [r[index]["peak"] for r in results[p]]
    simulated = [r[index]["simulated_peak"] for r in results[p]]
    assert measured == simulated


@pytest.mark.parametrize("p", WORLD_SIZES)
def test_weight_passes_run_after_their_input_passes(results, p):
    index = next(k for k, c in enumerate(CONFIGS) if c == dict(name="zb-h1"))
    for rank, result in enumerate(results[p]):
        order = result[index]["timeline"]
        ws = [a for a in order if "W" in a and "SEND" not in a and "RECV" not in a]
        assert ws, f"rank {rank} ran no W"
        for w in ws:
            stage, mb = w.split("W")
            assert order.index(f"{stage}I{mb}") < order.index(w)
