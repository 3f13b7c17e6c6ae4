// The two exact searches behind partition(); internal to csrc/plan.
#pragma once

#include <vector>

#include "plan/partitioner.h"
#include "plan/stage_costs.h"

namespace torchpp::plan {

// A split found by a search: stage boundaries and replicas per stage.
struct Split {
  std::vector<int> boundaries;
  std::vector<int> replicas;
};

// PipeDream's dynamic program over (layers placed, workers used[, stages formed]); v = 1.
Split solve_contiguous(const StageCosts& costs, const PartitionOptions& options);

// V-shaped placement, v = 2: DP cutting from both ends of the model at once.
Split solve_vshape(const StageCosts& costs, const PartitionOptions& options);

// Interleaved placement: branch and bound over the M*v stages (rank load = sum of its chunks).
Split solve_chunked(const StageCosts& costs, const PartitionOptions& options);

}  // namespace torchpp::plan
