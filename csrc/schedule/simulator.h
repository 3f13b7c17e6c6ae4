// Event-driven simulator: times every action of a schedule under given pass costs, exactly
// with the execution semantics of ir.h, and measures bubble and activation memory.
#pragma once

#include <vector>

#include "schedule/ir.h"

namespace torchpp::schedule {

// Cost of one pass of one stage for one microbatch, in any time unit; B costs i + w.
// Per-stage vectors, when non-empty, override the scalars (one entry per stage).
struct Costs {
  double f = 1.0;
  double i = 1.0;
  double w = 1.0;
  double comm = 0.0;  // latency of one stage-boundary transfer between different ranks
  std::vector<double> stage_f, stage_i, stage_w;

  double cost(ActionType type, int stage) const;
};

// Memory held per microbatch-stage: `activation` (M_B) from the start of F until the end of
// its I (or B); `weight_pending` (M_W) from the end of I until the end of its W. Default
// M_W = M_B / 2, the ratio the zero-bubble paper's scheduler assumes; per layer M_B = sb(34h+5as)
// and M_W = 32sbh (SPEC.md section 3), so the true ratio runs from ~0.9 (short s) to ~0.3.
struct MemoryUnits {
  double activation = 1.0;
  double weight_pending = 0.5;
};

struct TimedAction {
  Action action;
  double start = 0.0;
  double end = 0.0;
};

// A cross-rank transfer: produced by `producer` on src_rank at send_time, available to
// `consumer` on dst_rank at arrive_time = send_time + comm.
struct Transfer {
  int src_rank = 0;
  int dst_rank = 0;
  Action producer;
  Action consumer;
  double send_time = 0.0;
  double arrive_time = 0.0;
};

struct Simulation {
  double makespan = 0.0;
  // (max span - work) / max span, work being the busiest rank's compute time.
  double bubble_ratio = 0.0;
  std::vector<double> busy;        // per rank: compute time
  std::vector<double> span_start;  // per rank: start of its first action
  std::vector<double> span_end;    // per rank: end of its last action
  std::vector<double> idle;        // per rank: span - busy
  std::vector<int> peak_activations;     // per rank: most microbatch-stages between F and I/B
  std::vector<int> peak_weight_pending;  // per rank: most microbatch-stages between I and W
  std::vector<double> peak_memory;       // per rank: peak in MemoryUnits
  std::vector<std::vector<TimedAction>> timeline;  // per rank, compute actions in order
  std::vector<Transfer> transfers;
};

// Throws ScheduleError (with the grid, blocked steps marked) if the schedule deadlocks or an
// action waits for a pass that never runs. SEND/RECV actions of a lowered schedule are
// accounted as transfers of `comm` latency; they take no compute time.
Simulation simulate(const Schedule& schedule, const Costs& costs, const MemoryUnits& memory = {});

}  // namespace torchpp::schedule
