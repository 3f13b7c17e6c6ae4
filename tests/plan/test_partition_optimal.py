"""The partitioner finds the optimum: compared with brute force over every split."""
import itertools
import math
import random

import pytest

from torchpp.plan import partition


def compositions(n, parts):
    """Every way to cut n layers into `parts` non-empty contiguous stages (as boundaries)."""
    for cuts in itertools.combinations(range(1, n), parts - 1):
        yield [0, *cuts, n]


def rank_of(stage, workers, chunks, placement):
    if chunks == 1 or placement == "interleaved":
        return stage % workers
    return stage if stage < workers else 2 * workers - 1 - stage


def objective(case, boundaries, replicas, chunks=1, placement="interleaved"):
    """Slowest rank and boundary, or inf when a rank exceeds the budget; written from the spec."""
    compute, sent, params, state, saved, inflight, m = (case[k] for k in
                                                        ("compute", "sent", "params", "state", "saved", "inflight", "m"))
    rank_time, rank_memory, worst_link, worker = [0.0] * m, [0.0] * m, 0.0, 0
    for k, r in enumerate(replicas):
        layers = range(boundaries[k], boundaries[k + 1])
        work = sum(compute[l] for l in layers)
        sync = 2 * (r - 1) / r * sum(params[l] for l in layers) / case["sync_bw"] if r > 1 else 0.0
        time = max(work, sync) / r
        memory = sum(state[l] for l in layers) + sum(saved[l] for l in layers) * inflight[k]
        ranks = [rank_of(k, m, chunks, placement)] if chunks > 1 else range(worker, worker + r)
        for rank in ranks:
            rank_time[rank] += time
            rank_memory[rank] += memory
        prev = rank_of(k - 1, m, chunks, placement) if chunks > 1 else None
        if k > 0 and (chunks == 1 or prev != ranks[0]):
            worst_link = max(worst_link, 2 * sent[boundaries[k] - 1] / case["act_bw"])
        worker += r
    if max(rank_memory) > case["budget"]:
        return math.inf
    return max(max(rank_time), worst_link)


def brute_force(case, replicate=False, chunks=1, placement="interleaved"):
    n, m = len(case["compute"]), case["m"]
    best = math.inf
    stage_counts = range(1, m + 1) if replicate else [m * chunks]
    for stages in stage_counts:
        if stages > n:
            continue
        replica_sets = ([list(c) for c in itertools.product(range(1, m + 1), repeat=stages) if sum(c) == m]
                        if replicate else [[1] * stages])
        for boundaries in compositions(n, stages):
            for replicas in replica_sets:
                best = min(best, objective(case, boundaries, replicas, chunks, placement))
    return best


def random_case(rng, n, m, positions, budget=math.inf):
    integers = lambda: [float(rng.randint(1, 9)) for _ in range(n)]  # exact sums: ties compare equal
    return dict(compute=integers(), sent=integers(), params=integers(), state=integers(), saved=integers(),
                inflight=[float(rng.randint(1, 4)) for _ in range(positions)], m=m,
                act_bw=rng.choice([math.inf, 4.0]), sync_bw=rng.choice([math.inf, 2.0]), budget=budget)


def solve(case, **kwargs):
    return partition(case["compute"], case["m"], activation_bytes=case["sent"], parameter_bytes=case["params"],
                     state_bytes=case["state"], saved_activation_bytes=case["saved"], inflight=case["inflight"],
                     activation_bandwidth=case["act_bw"], sync_bandwidth=case["sync_bw"],
                     memory_budget=None if case["budget"] == math.inf else case["budget"], **kwargs)


@pytest.mark.parametrize("seed", range(40))
def test_pipeline_split_is_optimal(seed):
    rng = random.Random(seed)
    n, m = rng.randint(2, 9), rng.randint(1, 4)
    m = min(m, n)
    budget = rng.choice([math.inf, float(rng.randint(20, 60))])
    case = random_case(rng, n, m, positions=m, budget=budget)
    expected = brute_force(case)
    if expected == math.inf:
        with pytest.raises(ValueError, match="memory budget"):
            solve(case)
        return
    got = solve(case)
    assert got.bottleneck == expected
    assert objective(case, got.boundaries, got.replicas) == expected  # the split it returns scores that
    assert max(got.rank_memory) <= budget


@pytest.mark.parametrize("seed", range(30))
def test_replicated_split_is_optimal(seed):
    rng = random.Random(100 + seed)
    n, m = rng.randint(1, 6), rng.randint(1, 4)
    budget = rng.choice([math.inf, float(rng.randint(15, 50))])
    case = random_case(rng, n, m, positions=m, budget=budget)
    expected = brute_force(case, replicate=True)
    if expected == math.inf:
        with pytest.raises(ValueError, match="memory budget"):
            solve(case, replicate=True)
        return
    got = solve(case, replicate=True)
    assert got.bottleneck == pytest.approx(expected, rel=1e-12)
    assert sum(got.replicas) == m
    assert max(got.rank_memory) <= budget


@pytest.mark.parametrize("placement,chunks", [("v-shape", 2), ("interleaved", 2), ("interleaved", 3)])
@pytest.mark.parametrize("seed", range(12))
def test_chunked_split_is_optimal(placement, chunks, seed):
    rng = random.Random(1000 + seed)
    m = rng.randint(1, 3)
    n = rng.randint(m * chunks, m * chunks + 5)
    budget = rng.choice([math.inf, float(rng.randint(25, 70))])
    case = random_case(rng, n, m, positions=m * chunks, budget=budget)
    expected = brute_force(case, chunks=chunks, placement=placement)
    if expected == math.inf:
        with pytest.raises(ValueError, match="memory budget"):
            solve(case, num_chunks=chunks, placement=placement)
        return
    got = solve(case, num_chunks=chunks, placement=placement)
    assert got.bottleneck == expected
    assert objective(case, got.boundaries, got.replicas, chunks, placement) == expected
    assert max(got.rank_memory) <= budget


def test_v_shape_puts_first_and_last_stage_on_rank_zero():
    got = partition([1.0] * 8, 2, num_chunks=2, placement="v-shape")
    assert got.stage_rank == [0, 1, 1, 0]


def test_large_instance_is_fast_and_balanced():
    rng = random.Random(7)
    compute = [rng.uniform(0.5, 1.5) for _ in range(128)]
    got = partition(compute, 64, activation_bytes=[1.0] * 128, activation_bandwidth=100.0)
    assert len(got.replicas) == 64 and got.boundaries[-1] == 128
    assert got.bottleneck >= max(compute)  # a stage holds at least one layer
