"""Faults inside DualPipe's overlapped pairs (expert parallelism, ep=2 x pp=2 on 4 gloo ranks).

Under the forward-backward overlap rank 0 runs its forward of microbatch 1 (0F1, a worker thread)
at once with its backward of microbatch 2 (3B2). Whichever side raises, the other side and every
peer must end with an error within seconds: the failing side breaks the pipeline's groups and
the expert groups with their backward twins, so a peer waiting in an all-to-all for the rank
that raised (its ep partner, rank 1) returns, as does the other thread of the pair. The ranks of
rank 0's pipeline (0 and 2) carry its error; the other pipeline (ranks 1 and 3) fails on the
broken all-to-all and names where.
"""
import pytest
import torch

from fault_utils import FailsBackward, assert_outcomes, run_case

WITHIN_S = 30.0
N_MICROBATCHES = 4



def _case(kind: str):
    import torchpp
    from torchpp.models import parallelize
    from torchpp.testing.tiny_models import tiny_model

    import torch.distributed as dist

    state = torchpp.init_parallel(pp=2, ep=2)  # fresh groups: a failed step breaks its own
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = parallelize(tiny_model("mixtral"), state=state, ep=2, schedule="dualpipe",
                        n_microbatches=N_MICROBATCHES)
    assert model.schedule.overlap_forward_backward
    stages = {stage.index: stage for stage in model.pipeline_stages}
    calls = {"forward": 0, "backward": 0}
    if rank == 0 and kind == "raises_in_overlapped_forward":
        def before(module, args):  # 0F1: rank 0's second forward of stage 0, before its all-to-all
            calls["forward"] += 1
            if calls["forward"] == 2:
                raise RuntimeError("boom: forward failed on purpose")
        stages[0].layers[0].register_forward_pre_hook(before)
    if rank == 0 and kind == "raises_in_overlapped_backward":
        def after(module, args, output):  # 3F2: the first forward of schedule stage 3 (model stage 1 here)
            calls["backward"] += 1
            if calls["backward"] == 1:
                return (FailsBackward.apply(output[0]),) + tuple(output[1:]) if isinstance(output, tuple) \
                    else FailsBackward.apply(output)
            return None
        stages[1].layers[0].register_forward_hook(after)  # its backward, 3B2, raises
    ids = torch.randint(0, model.config.vocab_size, (N_MICROBATCHES, 16), generator=torch.Generator().manual_seed(1))
    return run_case(lambda: model.step(ids if model.has_first_stage else None, ids if model.has_last_stage else None))


EXPECTED = {
    "raises_in_overlapped_forward": ["boom: forward failed on purpose", "rank 0 failed at action 0F1"],
    "raises_in_overlapped_backward": ["boom: backward failed on purpose", "rank 0 failed at action 3B2"],
}


@pytest.mark.parametrize("kind", list(EXPECTED))
def test_a_raising_side_of_an_overlapped_pair_stops_every_rank(ranks, kind):
    outcomes = ranks(4).run(_case, kind, timeout=120)
    assert_outcomes(outcomes[0::2], "PipelineError", EXPECTED[kind], within_s=WITHIN_S)
    assert_outcomes(outcomes[1::2], "PipelineError", ["torchpp pipeline: rank", "at action"], within_s=WITHIN_S)
