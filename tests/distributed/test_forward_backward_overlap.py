"""DualPipe's forward-backward overlap under expert parallelism (torchpp.expert_parallel.overlap):
on by default for dualpipe / dualpipe-v with ep > 1, the executor runs each overlapped pair's
forward and backward at once (seen in its timeline, and on a track of its own in the real-run
Chrome trace), and the step equals the same step run one action at a time, in float64: loss and
every gradient. (tests/distributed/
test_expert_parallel_models.py also compares these schedules with the unwrapped model.)"""
import pytest

TIMEOUT_S = 300
OVERLAP_TRACK = 2  # the Chrome trace's "compute (overlapped)" track (csrc/schedule/trace.cpp)


def _overlapped_pairs(timeline):
    """Compute actions of this rank's last step whose spans intersect (run at once)."""
    spans = [(a, s, e) for a, s, e, _ in timeline if "SEND" not in a and "RECV" not in a]
    return [(a[0], b[0]) for i, a in enumerate(spans) for b in spans[i + 1:] if a[1] < b[2] and b[1] < a[2]]


def check_overlap_equals_sequential(schedule: str, n_microbatches: int) -> str:
    import copy
    import json

    import torch

    import torchpp
    from torchpp.models import parallelize
    from torchpp.pipeline.trace import chrome_trace_json, gather_runs
    from torchpp.testing.model_checks import assert_close, float64_throughout
    from torchpp.testing.tiny_models import tiny_model

    with float64_throughout():
        state = torchpp.init_parallel(pp=2, ep=2)
        model = tiny_model("mixtral")
        ids = torch.randint(0, model.config.vocab_size, (n_microbatches, 16),
                            generator=torch.Generator().manual_seed(3 + state.dp_rank))
        results = {}
        for overlap in (None, False):  # None: the default, which turns it on here
            wrapped = parallelize(copy.deepcopy(model), state=state, ep=2, schedule=schedule,
                                  n_microbatches=n_microbatches, overlap_forward_backward=overlap)
            assert wrapped.schedule.overlap_forward_backward is (overlap is None), overlap
            loss = wrapped.step(ids if wrapped.has_first_stage else None, ids if wrapped.has_last_stage else None)
            grads = {n: p.grad.clone() for n, p in wrapped.named_parameters() if p.grad is not None}
            trace = json.loads(chrome_trace_json(gather_runs(wrapped.schedule)))
            tracks = {(e["pid"], e["tid"]) for e in trace["traceEvents"] if e.get("ph") == "X"}
            results[overlap] = (loss, grads, _overlapped_pairs(wrapped.schedule.timeline()),
                                {pid for pid, tid in tracks if tid == OVERLAP_TRACK})
        (loss_on, grads_on, pairs_on, traced_on), (loss_off, grads_off, pairs_off, traced_off) = \
            results[None], results[False]
        assert pairs_on, f"no forward and backward ran at once under {schedule} with the overlap on"
        assert not pairs_off, pairs_off
        assert traced_on == set(range(4)) and not traced_off, (traced_on, traced_off)
        if loss_on is not None:
            assert_close(loss_on, loss_off, f"{schedule} loss with and without overlap")
        assert grads_on.keys() == grads_off.keys() and grads_on
        for name in grads_on:
            assert_close(grads_on[name], grads_off[name], f"{schedule} {name}.grad with and without overlap")
        return f"{len(pairs_on)} pairs at once, {len(grads_on)} grads equal"


@pytest.mark.parametrize("schedule, n_microbatches", [("dualpipe", 6), ("dualpipe-v", 4)])
def test_overlap_equals_one_action_at_a_time(ranks, schedule, n_microbatches):
    results = ranks(4).run(check_overlap_equals_sequential, schedule, n_microbatches, timeout=TIMEOUT_S)
    assert all("grads equal" in r for r in results), results


def check_overlap_refusals() -> bool:
    import pytest

    import torchpp
    from torchpp.models import parallelize
    from torchpp.testing.tiny_models import tiny_model

    state = torchpp.init_parallel(tp=2, pp=2)
    with pytest.raises(ValueError, match=r"overlap_forward_backward=True is not offered with tp=2"):
        parallelize(tiny_model("mixtral"), state=state, schedule="dualpipe", overlap_forward_backward=True)
    state = torchpp.init_parallel(ep=2)
    with pytest.raises(ValueError, match=r"not offered with pp=1"):
        parallelize(tiny_model("mixtral"), state=state, ep=2, overlap_forward_backward=True)
    with pytest.raises(TypeError, match=r"overlap_forward_backward must be None, True or False, got 'yes'"):
        parallelize(tiny_model("mixtral"), state=state, ep=2, overlap_forward_backward="yes")
    return True


def test_overlap_refusals_name_the_obstacle(ranks):
    assert ranks(4).run(check_overlap_refusals, timeout=TIMEOUT_S) == [True] * 4
