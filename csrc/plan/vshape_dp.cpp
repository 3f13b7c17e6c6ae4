// V-shaped placement (ZB-V, DualPipe-V): rank r holds stage r and stage 2M-1-r, so rank 0 gets
// the first and the last layers. Cutting from both ends at once keeps the DP polynomial:
// state (r, i, j) = ranks 0..r-1 hold the layers [0, i) and [j, N); O(M N^4) worst case.
#include <algorithm>
#include <limits>
#include <stdexcept>
#include <string>

#include "plan/solvers.h"

namespace torchpp::plan {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

}  // namespace

Split solve_vshape(const StageCosts& costs, const PartitionOptions& options) {
  const int n = costs.num_layers(), m = options.num_workers;
  if (n < 2 * m) {
    throw std::invalid_argument("cannot split " + std::to_string(n) + " layers into " + std::to_string(2 * m) +
                                " V-shaped stages (" + std::to_string(m) + " ranks x 2 chunks)");
  }
  auto index = [&](int r, int i, int j) { return (static_cast<size_t>(r) * (n + 1) + i) * (n + 1) + j; };
  std::vector<double> best(static_cast<size_t>(m) * (n + 1) * (n + 1), kInf);
  std::vector<int> parent_i(best.size(), -1), parent_j(best.size(), -1);
  best[index(0, 0, n)] = 0.0;

  // Ranks 0..m-2 each take a front stage [i, i2) and a back stage [j2, j).
  for (int r = 0; r + 1 < m; ++r) {
    const double front_inflight = costs.inflight(r), back_inflight = costs.inflight(2 * m - 1 - r);
    const int room = 2 * (m - r - 1);  // layers the later ranks need at least
    for (int i = 0; i < n; ++i) {
      for (int j = i + room + 2; j <= n; ++j) {
        const double reached = best[index(r, i, j)];
        if (reached == kInf) continue;
        // Both boundaries cross to rank r-1, except at the two ends of the model.
        const double before = std::max({reached, costs.comm(i), costs.comm(j)});
        for (int i2 = i + 1; i2 + room <= j - 1; ++i2) {
          const double front_memory = costs.memory(i, i2, front_inflight);
          if (!costs.fits(front_memory)) break;
          const double front = costs.compute(i, i2);
          for (int j2 = j - 1; j2 >= i2 + room; --j2) {
            if (!costs.fits(front_memory + costs.memory(j2, j, back_inflight))) break;
            const double value = std::max(before, front + costs.compute(j2, j));
            const size_t to = index(r + 1, i2, j2);
            if (value < best[to]) {
              best[to] = value;
              parent_i[to] = i;
              parent_j[to] = j;
            }
          }
        }
      }
    }
  }

  // The last rank holds the middle [i, j) as two adjacent stages: one load, any cut that fits.
  const int last = m - 1;
  double best_value = kInf;
  int best_i = -1, best_j = -1, best_cut = -1;
  for (int i = 0; i < n; ++i) {
    for (int j = i + 2; j <= n; ++j) {
      const double reached = best[index(last, i, j)];
      if (reached == kInf) continue;
      const double value = std::max({reached, costs.comm(i), costs.comm(j), costs.compute(i, j)});
      if (value >= best_value) continue;
      for (int cut = i + 1; cut < j; ++cut) {
        const double memory = costs.memory(i, cut, costs.inflight(last)) + costs.memory(cut, j, costs.inflight(m));
        if (costs.fits(memory)) {
          best_value = value;
          best_i = i, best_j = j, best_cut = cut;
          break;
        }
      }
    }
  }
  if (best_cut < 0) {
    throw std::invalid_argument("no V-shaped split of " + std::to_string(n) + " layers over " + std::to_string(m) +
                                " ranks fits the memory budget of " + std::to_string(options.memory_budget) +
                                " bytes per rank");
  }

  std::vector<int> boundaries(2 * m + 1);
  boundaries[0] = 0, boundaries[2 * m] = n, boundaries[m] = best_cut;
  for (int r = last, i = best_i, j = best_j; r > 0; --r) {
    boundaries[r] = i, boundaries[2 * m - r] = j;
    const size_t at = index(r, i, j);
    i = parent_i[at], j = parent_j[at];
  }
  return Split{boundaries, std::vector<int>(2 * m, 1)};
}

}  // namespace torchpp::plan
