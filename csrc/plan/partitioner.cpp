#include "plan/partitioner.h"

#include <algorithm>
#include <numeric>
#include <stdexcept>
#include <string>

#include "plan/solvers.h"
#include "plan/stage_costs.h"

namespace torchpp::plan {
namespace {

void require(bool ok, const std::string& message) {
  if (!ok) throw std::invalid_argument(message);
}

int num_stage_positions(const PartitionOptions& options) {
  return options.num_workers * options.num_chunks;
}

void check_options(const PartitionOptions& options) {
  require(options.num_chunks >= 1, "num_chunks must be >= 1, got " + std::to_string(options.num_chunks));
  require(options.max_replicas >= 0, "max_replicas must be >= 0 (0 = up to num_workers)");
  if (options.num_chunks > 1) {
    require(!options.allow_replication, "stage replication is not supported with num_chunks > 1");
    require(options.placement != Placement::kVShape || options.num_chunks == 2,
            "V-shaped placement needs num_chunks == 2, got " + std::to_string(options.num_chunks));
  }
  const int positions = num_stage_positions(options);
  require(options.inflight.empty() || static_cast<int>(options.inflight.size()) == positions,
          "inflight has " + std::to_string(options.inflight.size()) + " entries, expected one per stage position (" +
              std::to_string(positions) + ")");
}

}  // namespace

Partition partition(const LayerCosts& costs, const PartitionOptions& options) {
  check_options(options);
  const StageCosts stage_costs(costs, options);
  const Split split = options.num_chunks == 1                ? solve_contiguous(stage_costs, options)
                      : options.placement == Placement::kVShape ? solve_vshape(stage_costs, options)
                                                                : solve_chunked(stage_costs, options);
  return evaluate(costs, options, split.boundaries, split.replicas);
}

Partition evaluate(const LayerCosts& costs, const PartitionOptions& options, const std::vector<int>& boundaries,
                   const std::vector<int>& replicas) {
  check_options(options);
  const StageCosts stage_costs(costs, options);
  const int n = stage_costs.num_layers(), m = options.num_workers;
  const int stages = static_cast<int>(replicas.size());
  require(static_cast<int>(boundaries.size()) == stages + 1, "boundaries must have one more entry than replicas");
  require(boundaries.front() == 0 && boundaries.back() == n, "boundaries must run from 0 to the number of layers");
  for (int k = 0; k < stages; ++k) {
    require(boundaries[k] < boundaries[k + 1], "every stage needs at least one layer");
    require(replicas[k] >= 1, "every stage needs at least one replica");
  }
  const int workers = std::accumulate(replicas.begin(), replicas.end(), 0);
  if (options.num_chunks > 1) {
    require(stages == num_stage_positions(options), "a chunked split needs num_workers x num_chunks stages");
    require(workers == stages, "chunked stages are not replicated");
  } else {
    require(workers == m, "replicas must add up to num_workers (" + std::to_string(m) + "), got " +
                              std::to_string(workers));
  }

  Partition result;
  result.boundaries = boundaries;
  result.replicas = replicas;
  result.rank_time.assign(m, 0.0);
  result.rank_memory.assign(m, 0.0);
  int next_worker = 0;
  for (int k = 0; k < stages; ++k) {
    const int begin = boundaries[k], end = boundaries[k + 1];
    const double time = stage_costs.time(begin, end, replicas[k]);
    const double memory = stage_costs.memory(begin, end, stage_costs.inflight(k));
    const int rank = options.num_chunks > 1 ? rank_of_stage(k, m, options.num_chunks, options.placement) : next_worker;
    result.stage_rank.push_back(rank);
    result.stage_time.push_back(time);
    result.stage_memory.push_back(memory);
    // A replicated stage occupies workers [rank, rank + replicas): each runs the stage.
    for (int r = rank; r < rank + (options.num_chunks > 1 ? 1 : replicas[k]); ++r) {
      result.rank_time[r] += time;
      result.rank_memory[r] += memory;
    }
    next_worker += replicas[k];
    const bool crosses_ranks = k > 0 && result.stage_rank[k - 1] != rank;
    if (crosses_ranks) result.comm_time = std::max(result.comm_time, stage_costs.comm(begin));
  }
  const double slowest_rank = *std::max_element(result.rank_time.begin(), result.rank_time.end());
  result.bottleneck = std::max(slowest_rank, result.comm_time);
  return result;
}

}  // namespace torchpp::plan
