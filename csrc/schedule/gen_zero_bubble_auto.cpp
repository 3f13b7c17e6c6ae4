// zb-auto and the V family under a memory limit: grid search over the cost-aware schedulers'
// hyperparameters (greedy.h), keeping the valid schedule with the shortest simulated makespan
// within the memory limit.
#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <numeric>
#include <sstream>

#include "schedule/errors.h"
#include "schedule/generators_impl.h"
#include "schedule/greedy.h"

namespace torchpp::schedule::detail {

namespace {

constexpr double kTie = 1e-9;

double max_of(const std::vector<double>& values) { return *std::max_element(values.begin(), values.end()); }

// Objective: the single-iteration makespan (what a step with an optimizer barrier takes), then
// the longest rank span (the iteration time when iterations tile back to back, the paper's
// objective), or the two the other way round (span_first); then peak memory, then peak pending
// W's. A candidate over the memory limit is never kept.
struct Best {
  const Costs& costs;
  const MemoryUnits& memory;
  double memory_limit;
  bool span_first;
  Schedule schedule;
  double makespan = std::numeric_limits<double>::infinity();
  double span = std::numeric_limits<double>::infinity();
  double peak = std::numeric_limits<double>::infinity();
  int peak_w = std::numeric_limits<int>::max();

  // Returns whether the candidate fits the limit.
  bool offer(Schedule candidate) {
    Simulation sim = simulate(candidate, costs, memory);
    double peak_here = max_of(sim.peak_memory);
    if (peak_here > memory_limit + kTie) return false;
    double span_here = 0.0;
    for (size_t r = 0; r < sim.span_end.size(); r++) span_here = std::max(span_here, sim.span_end[r] - sim.span_start[r]);
    int peak_w_here = *std::max_element(sim.peak_weight_pending.begin(), sim.peak_weight_pending.end());
    auto key_less = [&]() {
      double first_here = span_first ? span_here : sim.makespan, first = span_first ? span : makespan;
      double second_here = span_first ? sim.makespan : span_here, second = span_first ? makespan : span;
      if (std::abs(first_here - first) > kTie) return first_here < first;
      if (std::abs(second_here - second) > kTie) return second_here < second;
      if (std::abs(peak_here - peak) > kTie) return peak_here < peak;
      return peak_w_here < peak_w;
    };
    if (key_less()) {
      makespan = sim.makespan;
      span = span_here;
      peak = peak_here;
      peak_w = peak_w_here;
      schedule = std::move(candidate);
    }
    return true;
  }
};

// The event-driven scheduler's settings: 8 switch combinations with every rank filling to the
// limit, each with three caps on deferred W's (none, one per stage held, one per activation the
// limit admits); for one stage per rank also tapered (1F1B's one activation less per rank,
// leaving memory to deferred W's), uncapped. Wider grids (a taper of 2, tapers with caps)
// gained under 0.1% on 1400 settings and cost as much time again.
// Returns how many settings gave a schedule within the limit.
int search_greedy(Best& best, const Schedule& skeleton, const Costs& costs, const MemoryUnits& memory,
                  double memory_limit, bool reserve_deeper_stages = false) {
  int fitting = 0;
  int stages_per_rank = skeleton.num_stages / skeleton.num_ranks;
  int activations = static_cast<int>(std::floor(memory_limit / memory.activation + kTie));
  std::vector<std::pair<int, int>> settings;  // (taper, cap)
  for (int cap : {1 << 30, stages_per_rank, activations}) settings.push_back({0, cap});
  if (stages_per_rank == 1) settings.push_back({1, 1 << 30});
  for (auto [taper, cap] : settings)
  for (int bits = 0; bits < 8; bits++) {
    GreedyPolicy policy;
    policy.memory_limit = memory_limit;
    policy.memory = memory;
    policy.activation_taper = taper;
    policy.max_pending_weights = std::max(cap, 1);
    policy.reserve_deeper_stages = reserve_deeper_stages;
    policy.forward_may_delay_backward = bits & 1;
    policy.weight_fills_short_gaps = bits & 2;
    policy.skip_forward_when_ahead = bits & 4;
    try {
      fitting += best.offer(greedy_schedule(skeleton, costs, policy));
    } catch (const ScheduleError&) {
      // this setting gets stuck under the limit; other settings may not
    }
  }
  return fitting;
}

// The paper's round-by-round heuristic with its three switches, so zb-auto is never worse
// than the paper's own scheduler on the same costs and limit.
void search_rounds(Best& best, const Schedule& skeleton, const Costs& costs, const MemoryUnits& memory,
                   double memory_limit) {
  for (int bits = 0; bits < 8; bits++) {
    RoundPolicy policy;
    policy.memory_limit = memory_limit;
    policy.memory = memory;
    policy.warmup_ends_before_backward = bits & 1;
    policy.skip_forward_when_ahead = bits & 2;
    policy.weight_fills_every_gap = bits & 4;
    try {
      best.offer(round_schedule(skeleton, costs, policy));
    } catch (const ScheduleError&) {
      // no room under the limit for this setting
    }
  }
}

std::string format(double value) {
  std::ostringstream out;
  out << value;
  return out.str();
}

// Per-stage costs that differ between stages (equal ones schedule as their scalar would).
bool has_stage_costs(const Costs& c) {
  for (const auto* values : {&c.stage_f, &c.stage_i, &c.stage_w}) {
    if (std::adjacent_find(values->begin(), values->end(), std::not_equal_to<double>()) != values->end()) return true;
  }
  return false;
}

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  size_t n = values.size();
  return n % 2 ? values[n / 2] : (values[n / 2 - 1] + values[n / 2]) / 2;  // as Python's statistics.median
}

// Per-stage costs replaced by each pass's median over the stages.
Costs median_costs(const Costs& costs) {
  Costs flat = costs;
  if (!flat.stage_f.empty()) flat.f = median(flat.stage_f);
  if (!flat.stage_i.empty()) flat.i = median(flat.stage_i);
  if (!flat.stage_w.empty()) flat.w = median(flat.stage_w);
  flat.stage_f.clear();
  flat.stage_i.clear();
  flat.stage_w.clear();
  return flat;
}

}  // namespace

Schedule zb_auto(int p, int m, const Costs& costs, const MemoryUnits& memory, double memory_limit, bool span_first) {
  std::vector<int> placement(p);
  std::iota(placement.begin(), placement.end(), 0);
  const Schedule skeleton = make_schedule("zb-auto", p, m, placement);
  Best best{costs, memory, memory_limit, span_first};
  search_greedy(best, skeleton, costs, memory, memory_limit);
  search_rounds(best, skeleton, costs, memory, memory_limit);
  // Given per-stage costs, the schedules their medians give compete too (judged on the real
  // costs): a schedule built from per-stage costs is never longer than one built from the median.
  if (has_stage_costs(costs)) {
    const Costs flat = median_costs(costs);
    search_greedy(best, skeleton, flat, memory, memory_limit);
    search_rounds(best, skeleton, flat, memory, memory_limit);
  }
  // The handcrafted schedules are points of the same space: offered as seeds (kept only
  // within the limit), zb-auto is never worse than ZB-H1/ZB-H2 where they fit.
  for (Schedule seed : {zb_h1(p, m), zb_h2(p, m)}) {
    seed.name = "zb-auto";
    best.offer(std::move(seed));
  }
  if (best.schedule.actions.empty()) {
    constraint_error("zb-auto", "a memory limit the heuristics can schedule under (at least M_B per rank)",
                     "memory_limit=" + format(memory_limit));
  }
  return best.schedule;
}

Schedule v_search(const std::string& name, int p, int m, const Costs& costs, const MemoryUnits& memory,
                  double memory_limit, bool span_first) {
  std::vector<int> placement(2 * p);
  for (int s = 0; s < 2 * p; s++) placement[s] = s < p ? s : 2 * p - 1 - s;
  Best best{costs, memory, memory_limit, span_first};
  const Schedule skeleton = make_schedule(name, p, m, placement);
  // Given per-stage costs, also what their medians give (see zb_auto), searched the same way.
  std::vector<Costs> schedule_on{costs};
  if (has_stage_costs(costs)) schedule_on.push_back(median_costs(costs));
  for (const Costs& c : schedule_on) {
    // Near 2p M_B with uneven costs every setting can fill rank r with stage r's activations and
    // wait forever for stage 2p-1-r; keeping a slot for the return leg gets through.
    if (search_greedy(best, skeleton, c, memory, memory_limit) == 0) {
      search_greedy(best, skeleton, c, memory, memory_limit, true);
    }
  }
  // The building blocks reach down to V-Min's memory, where the list scheduler may get stuck.
  for (Schedule seed : {v_min(p, m), v_half(p, m)}) {
    seed.name = name;
    best.offer(std::move(seed));
  }
  if (best.schedule.actions.empty()) {
    constraint_error(name, "a memory limit the V placement can schedule under (V-Min's peak is " +
                               format(max_of(simulate(v_min(p, m), costs, memory).peak_memory)) + ")",
                     "memory_limit=" + format(memory_limit));
  }
  return best.schedule;
}

}  // namespace torchpp::schedule::detail
