// O(1) cost of any contiguous layer range, from prefix sums; shared by every search.
#pragma once

#include <vector>

#include "plan/partitioner.h"

namespace torchpp::plan {

class StageCosts {
 public:
  // Validates the inputs (sizes, signs, bandwidths) and builds the prefix sums.
  StageCosts(const LayerCosts& costs, const PartitionOptions& options);

  int num_layers() const { return num_layers_; }
  // Layers [begin, end) on `replicas` workers: max(compute, gradient all-reduce) / replicas.
  double time(int begin, int end, int replicas) const;
  // Sending the activation into layer `boundary` forward and its gradient back.
  double comm(int boundary) const;
  // Bytes per worker for layers [begin, end) at a stage position that keeps `inflight` microbatches.
  double memory(int begin, int end, double inflight) const;
  // In-flight microbatches at stage position `position` (1 when the caller gave none).
  double inflight(int position) const;
  bool fits(double bytes) const { return bytes <= budget_; }
  double compute(int begin, int end) const { return compute_[end] - compute_[begin]; }

 private:
  int num_layers_;
  std::vector<double> compute_, params_, state_, saved_;  // prefix sums, size N+1
  std::vector<double> send_seconds_;                      // per layer: activation bytes / bandwidth
  std::vector<double> inflight_;
  double sync_bandwidth_;
  double budget_;
};

// Stage-to-rank map of the chunked placements (also used for v = 1: stage s on rank s).
int rank_of_stage(int stage, int num_workers, int num_chunks, Placement placement);

}  // namespace torchpp::plan
