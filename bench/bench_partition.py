"""Partitioner speed: C++ (torchpp._plan) vs the same DP in plain Python, N=128 layers, M=64 workers.

Run: PYTHONPATH=. python bench/bench_partition.py [--repeats 7]
"""
import argparse
import math
import random
import statistics
import time

from torchpp.plan import partition


def python_dp(compute, sent, m, bandwidth):
    """PipeDream's DP without replication, written plainly: best[w][j] over w stages, j layers."""
    n = len(compute)
    prefix = [0.0]
    for c in compute:
        prefix.append(prefix[-1] + c)
    best = [[math.inf] * (n + 1) for _ in range(m + 1)]
    best[0][0] = 0.0
    for w in range(m):
        for i in range(n):
            reached = best[w][i]
            if reached == math.inf:
                continue
            before = max(reached, 2 * sent[i - 1] / bandwidth if i > 0 else 0.0)
            for j in range(i + 1, n - (m - w - 1) + 1):
                value = max(before, prefix[j] - prefix[i])
                if value < best[w + 1][j]:
                    best[w + 1][j] = value
    return best[m][n]


def timed(fn, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return result, times


def summary(times):
    return f"median {statistics.median(times) * 1e3:9.2f} ms  spread {(max(times) - min(times)) * 1e3:8.2f} ms"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    rng = random.Random(0)
    n, m = 128, 64
    compute = [rng.uniform(0.5, 1.5) for _ in range(n)]
    sent = [rng.uniform(0.0, 0.2) for _ in range(n)]
    params = [rng.uniform(0.0, 1.0) for _ in range(n)]

    cpp, cpp_times = timed(lambda: partition(compute, m, activation_bytes=sent, activation_bandwidth=1.0), args.repeats)
    py, py_times = timed(lambda: python_dp(compute, sent, m, 1.0), max(3, args.repeats // 2))
    assert abs(cpp.bottleneck - py) < 1e-9, (cpp.bottleneck, py)
    print(f"pipeline DP   N={n} M={m}  C++ {summary(cpp_times)}")
    print(f"pipeline DP   N={n} M={m}  Py  {summary(py_times)}  ratio {statistics.median(py_times) / statistics.median(cpp_times):.0f}x")
    _, rep_times = timed(lambda: partition(compute, m, activation_bytes=sent, activation_bandwidth=1.0,
                                           parameter_bytes=params, replicate=True, sync_bandwidth=2.0), args.repeats)
    print(f"replicated DP N={n} M={m}  C++ {summary(rep_times)}")
    _, v_times = timed(lambda: partition(compute, 16, num_chunks=2, placement="v-shape"), args.repeats)
    print(f"V-shape DP    N={n} M=16 v=2  C++ {summary(v_times)}")
    _, il_times = timed(lambda: partition(compute[:32], 4, num_chunks=2), args.repeats)
    print(f"interleaved B&B N=32 M=4 v=2  C++ {summary(il_times)}")


if __name__ == "__main__":
    main()
