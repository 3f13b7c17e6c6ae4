// Schedule generators: every pipeline schedule torchpp knows, by name.
#pragma once

#include <string>
#include <vector>

#include "schedule/ir.h"
#include "schedule/simulator.h"

namespace torchpp::schedule {

struct GenerateOptions {
  int num_ranks = 1;
  int num_microbatches = 1;
  int num_chunks = 0;             // stages per rank; 0 picks the schedule's default
  Costs costs;                    // pass costs, used by the cost-aware generators (zb-auto, zb-v)
  // zb-auto and the V family (zb-v, v-half, v-min): most memory per rank, M_B (memory.activation)
  // per activation held from F to I plus M_W (memory.weight_pending) per W pending from I to W;
  // 0 = default (p M_B, zb-v 2p M_B; v-half / v-min without a limit: their building blocks).
  double memory_limit = 0.0;
  MemoryUnits memory;             // M_B = 1, M_W = 1/2 unless set (the zero-bubble paper's estimate)
  // zb-auto/zb-v: what the search minimizes first, "makespan" (one step with an optimizer
  // barrier) or "span" (the longest rank span: steps back to back, the paper's objective).
  std::string objective = "makespan";
  int microbatch_group_size = 0;  // interleaved-1f1b/-zb: microbatches per depth-first group; 0 = p
};

// Builds schedule `name` (see schedule_names()). Throws std::invalid_argument naming the failed
// constraint and the values when the schedule cannot serve the options; never falls back.
Schedule generate(const std::string& name, const GenerateOptions& options);

// gpipe, 1f1b, eager-1f1b, interleaved-1f1b, looped-bfs, zb-h1, zb-h2, zb-auto, interleaved-zb, zb-v,
// v-half, v-min, dualpipe, dualpipe-v.
std::vector<std::string> schedule_names();

}  // namespace torchpp::schedule
