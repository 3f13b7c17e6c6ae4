// zb-auto and zb-v: grid search over the greedy scheduler's hyperparameters (greedy.h),
// keeping the valid schedule with the shortest simulated makespan.
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "schedule/errors.h"
#include "schedule/generators_impl.h"
#include "schedule/greedy.h"

namespace torchpp::schedule::detail {

namespace {

// Objective: the longest rank span (the iteration time when iterations tile back to back, what
// the bubble ratio measures), then the single-iteration makespan, then peak activations, then
// peak pending W's.
struct Best {
  Schedule schedule;
  double span = std::numeric_limits<double>::infinity();
  double makespan = std::numeric_limits<double>::infinity();
  int peak = std::numeric_limits<int>::max();
  int peak_w = std::numeric_limits<int>::max();

  void offer(Schedule candidate, const Costs& costs) {
    Simulation sim = simulate(candidate, costs);
    double span_here = 0.0;
    for (size_t r = 0; r < sim.span_end.size(); r++) span_here = std::max(span_here, sim.span_end[r] - sim.span_start[r]);
    int peak_here = *std::max_element(sim.peak_activations.begin(), sim.peak_activations.end());
    int peak_w_here = *std::max_element(sim.peak_weight_pending.begin(), sim.peak_weight_pending.end());
    constexpr double kTie = 1e-9;
    auto key_less = [&]() {
      if (std::abs(span_here - span) > kTie) return span_here < span;
      if (std::abs(sim.makespan - makespan) > kTie) return sim.makespan < makespan;
      if (peak_here != peak) return peak_here < peak;
      return peak_w_here < peak_w;
    };
    if (key_less()) {
      span = span_here;
      makespan = sim.makespan;
      peak = peak_here;
      peak_w = peak_w_here;
      schedule = std::move(candidate);
    }
  }
};

// Caps on deferred W's tried besides "none": one per stage held, and one per microbatch-stage
// the activation limit admits (the paper's 1F-1I-1W steady state keeps few W's pending).
void search(Best& best, const Schedule& skeleton, const Costs& costs, double memory_limit) {
  int stages_per_rank = skeleton.num_stages / skeleton.num_ranks;
  for (int cap : {1 << 30, stages_per_rank, static_cast<int>(memory_limit)})
  for (int bits = 0; bits < 8; bits++) {
    GreedyPolicy policy;
    policy.max_pending_weights = std::max(cap, 1);
    policy.memory_limit = memory_limit;
    policy.forward_may_delay_backward = bits & 1;
    policy.weight_fills_short_gaps = bits & 2;
    policy.skip_forward_when_ahead = bits & 4;
    try {
      best.offer(greedy_schedule(skeleton, costs, policy), costs);
    } catch (const ScheduleError&) {
      // this setting gets stuck under the limit; other settings may not
    }
  }
}

}  // namespace

Schedule zb_auto(int p, int m, const Costs& costs, double memory_limit) {
  std::vector<int> placement(p);
  std::iota(placement.begin(), placement.end(), 0);
  Best best;
  search(best, make_schedule("zb-auto", p, m, placement), costs, memory_limit);
  // The handcrafted schedules are points of the same space: start the search from them when
  // they fit the limit, so zb-auto is never worse than ZB-H1/ZB-H2 at their memory.
  for (Schedule seed : {zb_h1(p, m), zb_h2(p, m)}) {
    Simulation sim = simulate(seed, costs);
    if (*std::max_element(sim.peak_activations.begin(), sim.peak_activations.end()) <= memory_limit + 1e-9) {
      seed.name = "zb-auto";
      best.offer(std::move(seed), costs);
    }
  }
  if (best.schedule.actions.empty()) {
    constraint_error("zb-auto", "a memory limit the heuristics can schedule under (at least 1 activation per rank)",
                     "memory_limit=" + std::to_string(memory_limit));
  }
  return best.schedule;
}

Schedule zb_v(int p, int m, const Costs& costs, double memory_limit) {
  std::vector<int> placement(2 * p);
  for (int s = 0; s < 2 * p; s++) placement[s] = s < p ? s : 2 * p - 1 - s;
  Best best;
  search(best, make_schedule("zb-v", p, m, placement), costs, memory_limit);
  if (best.schedule.actions.empty()) {
    constraint_error("zb-v", "a memory limit the V placement can schedule under (at least 2 activations per rank)",
                     "memory_limit=" + std::to_string(memory_limit));
  }
  return best.schedule;
}

}  // namespace torchpp::schedule::detail
