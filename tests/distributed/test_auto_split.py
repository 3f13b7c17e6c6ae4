"""parallelize(..., split="auto"): a quick profile plus the partitioner gives a valid split whose
loss and gradients equal the unwrapped model's; the chosen split balances an uneven profile; the
cost-aware schedules are generated on the profiled per-stage costs."""
import copy
import itertools

import torch.distributed as dist

import torchpp
from torchpp import schedule as S
from torchpp.models import auto_split as auto_split_module
from torchpp.models import parallelize
from torchpp.models.auto_split import choose_split, stage_costs
from torchpp.plan import LayerProfile
from hf_reference import batch, check_wrapped_step, hf_names, reference_step, tiny_model

NUM_LAYERS = 6
CASES = ("1f1b", "interleaved-1f1b", "dualpipe", "zb-auto", "zb-v")


def _slowest_rank(costs, bounds, rank_of, pp):
    per_rank = [0.0] * pp
    for stage, (a, b) in enumerate(zip(bounds, bounds[1:])):
        per_rank[rank_of[stage]] += sum(costs[a:b])
    return max(per_rank)


def _brute_force(costs, num_stages, rank_of, pp):
    n = len(costs)
    return min(_slowest_rank(costs, [0, *cut, n], rank_of, pp)
               for cut in itertools.combinations(range(1, n), num_stages - 1))


def test_choice_balances_an_uneven_profile():
    pp, one_chunk = 2, {0: 0, 1: 1}
    costs = [8.0, 1, 1, 1, 1, 1, 1, 1]  # a heavy first layer: the even split [4] is 11 vs 4
    assert choose_split(costs, 2, pp, one_chunk) == [1]
    # The embedding's cost lands on the first stage, the head's on the last.
    flat = [1.0] * 8
    assert choose_split(flat, 2, pp, one_chunk) == [4]
    assert choose_split(flat, 2, pp, one_chunk, first_extra=4.0) == [2]
    assert choose_split(flat, 2, pp, one_chunk, last_extra=4.0) == [6]
    # Interleaved (stage s on rank s % 2) and V-shape (stages 0 and 3 on rank 0): optimal by brute force.
    uneven = [5.0, 1, 2, 7, 1, 1, 3, 2, 6, 1]
    for rank_of in ({0: 0, 1: 1, 2: 0, 3: 1}, {0: 0, 1: 1, 2: 1, 3: 0}):
        split = choose_split(uneven, 4, pp, rank_of, first_extra=1.0, last_extra=2.0)
        charged = [uneven[0] + 1.0, *uneven[1:-1], uneven[-1] + 2.0]
        assert _slowest_rank(charged, [0, *split, len(uneven)], rank_of, pp) == _brute_force(charged, 4, rank_of, pp)


def test_stage_costs_sum_each_pass_per_stage():
    layers = [LayerProfile(f"l{k}", 1.0 + k, 2.0 + k, 0.5 * k, 0, 0, 0) for k in range(4)]
    embedding, head = LayerProfile("e", 0.25, 0.5, 0.125, 0, 0, 0), LayerProfile("h", 3.0, 4.0, 1.0, 0, 0, 0)
    costs = stage_costs(layers, [1, 3], embedding, head)
    assert costs.f == (1.25, 2.0 + 3.0, 4.0 + 3.0)
    assert costs.i == (2.5, 3.0 + 4.0, 5.0 + 4.0)
    assert costs.w == (0.125, 0.5 + 1.0, 1.5 + 1.0)


def check_auto_split(schedule, n_microbatches):
    state = torchpp.init_parallel(tp=1, pp=2)
    model = tiny_model("llama", num_layers=NUM_LAYERS)
    reference = copy.deepcopy(model)
    ids, labels = batch(model.config.vocab_size)
    _, ref_loss, ref_grads = reference_step(reference, ids, labels)

    answers = []
    profiled = auto_split_module.auto_split
    auto_split_module.auto_split = lambda *args, **kw: answers.append(profiled(*args, **kw)) or answers[-1]
    try:
        wrapped = parallelize(model, schedule=schedule, n_microbatches=n_microbatches, split="auto", state=state)
    finally:
        auto_split_module.auto_split = profiled
    what = f"llama pp=2 {schedule} split=auto rank={dist.get_rank()}"
    split, costs = answers[0]
    assert len(costs.f) == len(split) + 1 and all(x > 0 for x in costs.f + costs.i), f"{what}: {costs}"
    if schedule in ("zb-auto", "zb-v"):  # generated on the profiled per-stage costs
        expected = S.generate(schedule, 2, n_microbatches, costs=costs)
        compiled = wrapped.schedule.schedule
        assert [compiled.actions(r) for r in range(2)] == [expected.actions(r) for r in range(2)], what
    mine = {index: len(stage.layers) for index, stage in zip(wrapped.stage_indices, wrapped.pipeline_stages)}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    layers = {index: n for part in every for index, n in part.items()}
    assert sorted(layers) == list(range(len(layers))), f"{what}: stages {sorted(layers)}"
    assert all(n >= 1 for n in layers.values()) and sum(layers.values()) == NUM_LAYERS, f"{what}: {layers}"
    return check_wrapped_step(wrapped, ids, labels, ref_loss, ref_grads, what)


def check_all():
    # DualPipe: each rank holds stages r and p-1-r, and a stage's rank is its pipeline-0 copy's.
    return [check_auto_split(name, 4) for name in CASES]


def test_auto_split_matches_unwrapped(ranks):
    per_rank = ranks(2).run(check_all, timeout=240)
    for case in range(len(CASES)):
        covered = set().union(*(set(names[case]) for names in per_rank))
        assert covered == hf_names(tiny_model("llama", num_layers=NUM_LAYERS)), f"case {case}: {covered}"
