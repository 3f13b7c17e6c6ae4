#include "schedule/simulator.h"

#include <algorithm>
#include <sstream>

#include "schedule/dependencies.h"
#include "schedule/errors.h"
#include "schedule/grid.h"
#include "schedule/lowering.h"

namespace torchpp::schedule {

double Costs::cost(ActionType type, int stage) const {
  auto pick = [&](const std::vector<double>& per_stage, double scalar) {
    return per_stage.empty() ? scalar : per_stage.at(stage);
  };
  switch (type) {
    case ActionType::F: return pick(stage_f, f);
    case ActionType::I: return pick(stage_i, i);
    case ActionType::W: return pick(stage_w, w);
    case ActionType::B: return pick(stage_i, i) + pick(stage_w, w);
    default: return 0.0;
  }
}

namespace {

[[noreturn]] void report_deadlock(const Schedule& s, const std::vector<size_t>& next,
                                  const std::vector<double>& done, const PassIndex& index) {
  std::ostringstream msg;
  msg << "schedule '" << s.name << "' deadlocks: every unfinished rank waits for a pass that no "
      << "rank can run first\n";
  std::vector<std::pair<int, int>> marks;
  for (int r = 0; r < s.num_ranks; r++) {
    if (next[r] >= s.actions[r].size()) continue;
    const Action& a = s.actions[r][next[r]];
    marks.emplace_back(r, static_cast<int>(next[r]));
    Dependency deps[2];
    int n = dependencies(s, a, deps);
    for (int d = 0; d < n; d++) {
      if (done[index.key(deps[d].stage, deps[d].microbatch, deps[d].pass)] >= 0) continue;
      static const char* kPass[] = {"forward", "input gradient", "weight gradient"};
      msg << "  rank " << r << " step " << next[r] << ": " << a.str() << " waits for the "
          << kPass[static_cast<int>(deps[d].pass)] << " of stage " << deps[d].stage
          << " microbatch " << deps[d].microbatch << '\n';
    }
  }
  std::sort(marks.begin(), marks.end(),
            [](const auto& x, const auto& y) { return x.second < y.second; });
  throw ScheduleError(msg.str() + format_grid(s, marks));
}

void measure_memory(const std::vector<TimedAction>& timeline, const MemoryUnits& units,
                    int& peak_b, int& peak_w, double& peak_mem) {
  int held_b = 0, held_w = 0;
  peak_b = peak_w = 0;
  peak_mem = 0.0;
  for (const TimedAction& t : timeline) {
    switch (t.action.type) {
      case ActionType::F: held_b++; break;
      case ActionType::I: held_b--; held_w++; break;
      case ActionType::B: held_b--; break;
      case ActionType::W: held_w--; break;
      default: break;
    }
    peak_b = std::max(peak_b, held_b);
    peak_w = std::max(peak_w, held_w);
    peak_mem = std::max(peak_mem, units.activation * held_b + units.weight_pending * held_w);
  }
}

}  // namespace

Simulation simulate(const Schedule& input, const Costs& costs, const MemoryUnits& memory) {
  const Schedule compute = input.lowered ? compute_only(input) : Schedule{};
  const Schedule& s = input.lowered ? compute : input;
  const int p = s.num_ranks;
  const PassIndex index{s.num_microbatches, s.num_stages};
  std::vector<double> done(index.size(), -1.0);  // end time of each pass, -1 until it ran
  std::vector<ActionType> producer(index.size(), ActionType::F);
  std::vector<size_t> next(p, 0);
  std::vector<double> free_at(p, 0.0);
  Simulation sim;
  sim.timeline.assign(p, {});

  size_t remaining = 0;
  for (const auto& row : s.actions) remaining += row.size();
  auto check_action = [&](int r, const Action& a) {
    if (a.stage < 0 || a.stage >= s.num_stages || a.microbatch < 0 ||
        a.microbatch >= s.num_microbatches || !is_compute(a.type)) {
      throw ScheduleError("schedule '" + s.name + "': rank " + std::to_string(r) + " action " +
                          a.str() + " is out of range for " + std::to_string(s.num_stages) +
                          " stages and " + std::to_string(s.num_microbatches) + " microbatches");
    }
  };
  while (remaining > 0) {
    bool progress = false;
    for (int r = 0; r < p; r++) {
      while (next[r] < s.actions[r].size()) {
        const Action& a = s.actions[r][next[r]];
        check_action(r, a);
        Dependency deps[2];
        int n = dependencies(s, a, deps);
        double ready = free_at[r];
        bool runnable = true;
        for (int d = 0; d < n && runnable; d++) {
          double t = done[index.key(deps[d].stage, deps[d].microbatch, deps[d].pass)];
          if (t < 0) runnable = false;
          else ready = std::max(ready, t + (s.stage_to_rank[deps[d].stage] != r ? costs.comm : 0.0));
        }
        if (!runnable) break;
        double end = ready + costs.cost(a.type, a.stage);
        for (int d = 0; d < n; d++) {
          int src = s.stage_to_rank[deps[d].stage];
          if (src == r) continue;
          int key = index.key(deps[d].stage, deps[d].microbatch, deps[d].pass);
          sim.transfers.push_back({src, r, Action{deps[d].stage, producer[key], deps[d].microbatch}, a,
                                   done[key], done[key] + costs.comm});
        }
        Pass pass = pass_of(a.type);
        int key = index.key(a.stage, a.microbatch, pass);
        done[key] = end;
        producer[key] = a.type;
        if (a.type == ActionType::B) done[index.key(a.stage, a.microbatch, Pass::WeightGrad)] = end;
        sim.timeline[r].push_back({a, ready, end});
        free_at[r] = end;
        next[r]++;
        remaining--;
        progress = true;
      }
    }
    if (!progress) report_deadlock(s, next, done, index);
  }

  sim.busy.assign(p, 0.0);
  sim.span_start.assign(p, 0.0);
  sim.span_end.assign(p, 0.0);
  sim.idle.assign(p, 0.0);
  sim.peak_activations.assign(p, 0);
  sim.peak_weight_pending.assign(p, 0);
  sim.peak_memory.assign(p, 0.0);
  double max_span = 0.0, max_busy = 0.0;
  for (int r = 0; r < p; r++) {
    const auto& line = sim.timeline[r];
    for (const TimedAction& t : line) sim.busy[r] += t.end - t.start;
    if (!line.empty()) {
      sim.span_start[r] = line.front().start;
      sim.span_end[r] = line.back().end;
    }
    double span = sim.span_end[r] - sim.span_start[r];
    sim.idle[r] = span - sim.busy[r];
    max_span = std::max(max_span, span);
    max_busy = std::max(max_busy, sim.busy[r]);
    sim.makespan = std::max(sim.makespan, sim.span_end[r]);
    measure_memory(line, memory, sim.peak_activations[r], sim.peak_weight_pending[r],
                   sim.peak_memory[r]);
  }
  sim.bubble_ratio = max_span > 0 ? (max_span - max_busy) / max_span : 0.0;
  return sim;
}

}  // namespace torchpp::schedule
