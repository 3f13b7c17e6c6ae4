// Cost- and memory-aware schedulers behind zb-auto and zb-v: the heuristics of the zero-bubble
// automatic scheduler (arXiv 2401.10241, SPEC.md section 3), one hyperparameter setting per
// call; the generators grid-search the settings and keep the shortest result.
//
// Memory, as the paper counts it: a microbatch-stage holds `memory.activation` (M_B) from the
// start of its F until the end of its I, then `memory.weight_pending` (M_W) until the end of its
// W. `memory_limit` bounds the sum per rank, in the same unit.
#pragma once

#include "schedule/ir.h"
#include "schedule/simulator.h"

namespace torchpp::schedule::detail {

struct GreedyPolicy {
  // Most memory a rank may hold (M_B per activation plus M_W per pending W).
  double memory_limit = 1.0;
  MemoryUnits memory;
  // Tapered warm-up: rank r holds at most floor(memory_limit / M_B) - activation_taper * r
  // activations (at least 1), as 1F1B (taper 1) or ZB-H2 (taper 2) do; the memory it leaves
  // holds deferred W's. 0: every rank fills to the limit.
  int activation_taper = 0;
  // Run a ready F even when a backward becomes ready before that F ends (warm-up's extra F).
  bool forward_may_delay_backward = false;
  // Put a W into a gap shorter than T_W when idling would make this rank's accumulated bubble
  // the largest of all ranks.
  bool weight_fills_short_gaps = true;
  // When a stage is more than one F ahead of the next stage, prefer a pending W over the F.
  bool skip_forward_when_ahead = false;
  // Most deferred W's a rank may hold; a W runs first once this many are pending.
  int max_pending_weights = 1 << 30;
  // Several stages per rank: an F leaves room for one activation of each deeper stage of the
  // rank that holds none (the V's return leg) instead of filling the limit with shallow ones.
  bool reserve_deeper_stages = false;
};

// Event-driven list scheduler: fills `skeleton` (placement set, one pipeline, empty action
// lists) with I/W-split actions, each rank taking the best ready action whenever it idles.
// Throws ScheduleError if the policy gets stuck (e.g. a memory limit below what the placement
// needs).
Schedule greedy_schedule(Schedule skeleton, const Costs& costs, const GreedyPolicy& policy);

// The paper's own heuristic, round by round (one stage per rank, stage r on rank r): round 0
// runs F0 everywhere plus the warm-up F's that fit before I0 comes back, tapered so each rank
// runs fewer than the one before; round k gives each rank one F (unless the skip rule holds it
// back) and then I k from the last rank to the first, W's filling the gaps before each.
struct RoundPolicy {
  double memory_limit = 1.0;
  MemoryUnits memory;
  // Warm-up F's must end before I0 arrives (true) or only start before it (false).
  bool warmup_ends_before_backward = true;
  // A rank two or more F's ahead of the next skips its F when that adds no bubble.
  bool skip_forward_when_ahead = false;
  // A gap shorter than T_W gets a W whenever one is pending (true), or only when idling would
  // make this rank's bubble the largest (false).
  bool weight_fills_every_gap = true;
};

// Throws ScheduleError when the limit leaves no room (no W pending to free memory).
Schedule round_schedule(Schedule skeleton, const Costs& costs, const RoundPolicy& policy);

}  // namespace torchpp::schedule::detail
