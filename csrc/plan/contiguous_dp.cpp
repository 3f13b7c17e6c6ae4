// PipeDream's dynamic program (SPEC section 6):
//   A(j, m) = min over i < j, r of max(A(i, m - r), 2 C_i, T(i+1..j, r))
// extended with a per-worker memory budget. The new stage's in-flight count depends on its
// position; without replication the position equals the workers used so far, with replication
// (and a position-dependent in-flight vector) the DP also tracks the number of stages formed.
#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <stdexcept>
#include <string>

#include "plan/solvers.h"

namespace torchpp::plan {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

bool all_equal(const std::vector<double>& values) {
  return std::adjacent_find(values.begin(), values.end(), std::not_equal_to<>()) == values.end();
}

}  // namespace

Split solve_contiguous(const StageCosts& costs, const PartitionOptions& options) {
  const int n = costs.num_layers();
  const int m = options.num_workers;
  const int max_replicas =
      options.allow_replication ? (options.max_replicas > 0 ? std::min(options.max_replicas, m) : m) : 1;
  if (max_replicas == 1 && n < m) {
    throw std::invalid_argument("cannot split " + std::to_string(n) + " layers into " + std::to_string(m) +
                                " stages of at least one layer each without replication");
  }
  // Only then does a stage's position differ from the workers used before it.
  const bool track_stages = max_replicas > 1 && std::isfinite(options.memory_budget) && !all_equal(options.inflight);
  const int num_k = track_stages ? m + 1 : 1;

  auto index = [&](int k, int layers, int workers) { return (static_cast<size_t>(k) * (n + 1) + layers) * (m + 1) + workers; };
  std::vector<double> best(static_cast<size_t>(num_k) * (n + 1) * (m + 1), kInf);
  std::vector<int> parent_begin(best.size(), -1), parent_replicas(best.size(), 0);
  best[index(0, 0, 0)] = 0.0;

  // Workers strictly increase along every transition, so sweeping them in order finalises states.
  for (int w = 0; w < m; ++w) {
    for (int k = 0; k < num_k; ++k) {
      for (int i = 0; i < n; ++i) {
        const double reached = best[index(k, i, w)];
        if (reached == kInf) continue;
        const double before = std::max(reached, costs.comm(i));
        const int position = track_stages ? k : (max_replicas == 1 ? w : 0);
        const double inflight = costs.inflight(position);
        const int next_k = track_stages ? k + 1 : 0;
        // Without replication every later worker still needs a layer of its own.
        const int last = max_replicas == 1 ? n - (m - w - 1) : n;
        for (int j = i + 1; j <= last; ++j) {
          if (!costs.fits(costs.memory(i, j, inflight))) break;  // memory only grows with j
          for (int r = 1; r <= std::min(max_replicas, m - w); ++r) {
            const bool done_layers = j == n, done_workers = w + r == m;
            if (done_layers != done_workers) continue;  // a dead end: layers or workers left over
            const double value = std::max(before, costs.time(i, j, r));
            const size_t to = index(next_k, j, w + r);
            if (value < best[to]) {
              best[to] = value;
              parent_begin[to] = i;
              parent_replicas[to] = r;
            }
          }
        }
      }
    }
  }

  int best_k = -1;
  for (int k = 0; k < num_k; ++k) {
    if (best[index(k, n, m)] < kInf && (best_k < 0 || best[index(k, n, m)] < best[index(best_k, n, m)])) best_k = k;
  }
  if (best_k < 0) {
    throw std::invalid_argument("no split of " + std::to_string(n) + " layers over " + std::to_string(m) +
                                " workers fits the memory budget of " + std::to_string(options.memory_budget) +
                                " bytes per worker");
  }

  Split split;
  for (int k = best_k, j = n, w = m; j > 0;) {
    const size_t at = index(k, j, w);
    split.boundaries.push_back(j);
    split.replicas.push_back(parent_replicas[at]);
    const int i = parent_begin[at];
    w -= parent_replicas[at];
    j = i;
    k = track_stages ? k - 1 : 0;
  }
  split.boundaries.push_back(0);
  std::reverse(split.boundaries.begin(), split.boundaries.end());
  std::reverse(split.replicas.begin(), split.replicas.end());
  return split;
}

}  // namespace torchpp::plan
