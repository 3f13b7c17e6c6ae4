"""TP=2 x PP=2 on 4 gloo ranks: column/row-parallel split-B/W blocks in a zero-bubble
pipeline, with Megatron's scatter/gather P2P on and off, equal to the single-process model."""
import math

import pytest

from pipeline_checks import config_results, run_tp_pp

CONFIGS = [
    dict(name="zb-h1", scatter_gather=True),
    dict(name="zb-h1", scatter_gather=False),
    dict(name="1f1b", scatter_gather=True),
    dict(name="interleaved-1f1b", scatter_gather=True, m=4, batch=12, seq_lens=(5, 5)),
    dict(name="zb-v", scatter_gather=True, in_order_p2p=True),
]


@pytest.fixture(scope="module")
def results(ranks):
    return ranks(4).run(run_tp_pp, CONFIGS, timeout=240)


@pytest.mark.parametrize("index", range(len(CONFIGS)), ids=[f"{c['name']}-sg={c['scatter_gather']}" + ("-in-order" if c.get("in_order_p2p") else "")
                                                    for c in CONFIGS])
def test_tp_pp_matches_reference(results, index):
    per_rank = config_results(results, index)
    # Loss shares of one TP group (ranks 2 and 3 hold the last stage and see the same loss).
    for step in range(2):
        for tp in (0, 1):
            ranks_of_tp = [tp, 2 + tp]
            total = sum(per_rank[r]["steps"][step]["loss_share"] for r in ranks_of_tp)
            assert math.isclose(total, per_rank[0]["steps"][step]["ref_loss"], rel_tol=1e-10)
