// Cost- and memory-aware list scheduler behind zb-auto and zb-v: the heuristics of the
// zero-bubble automatic scheduler (arXiv 2401.10241, SPEC.md section 3), one hyperparameter
// setting per call; the generators grid-search the settings and keep the shortest result.
#pragma once

#include "schedule/ir.h"
#include "schedule/simulator.h"

namespace torchpp::schedule::detail {

struct GreedyPolicy {
  // Max activations (F run, I not yet) a rank may hold, in microbatch-stage units.
  double memory_limit = 1.0;
  // Run a ready F even when a backward becomes ready before that F ends (warm-up's extra F).
  bool forward_may_delay_backward = false;
  // Put a W into a gap shorter than T_W when idling would make this rank's accumulated bubble
  // the largest of all ranks.
  bool weight_fills_short_gaps = true;
  // When a stage is more than one F ahead of the next stage, prefer a pending W over the F.
  bool skip_forward_when_ahead = false;
  // Most deferred W's (M_W each) a rank may hold; a W runs first once this many are pending.
  int max_pending_weights = 1 << 30;
};

// Fills `skeleton` (placement set, one pipeline, empty action lists) with I/W-split actions.
// Throws ScheduleError if the policy gets stuck (e.g. a memory limit below what the
// placement needs).
Schedule greedy_schedule(Schedule skeleton, const Costs& costs, const GreedyPolicy& policy);

}  // namespace torchpp::schedule::detail
