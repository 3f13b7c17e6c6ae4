// PipeDream's partitioner (Narayanan et al., SOSP'19): split a chain of N layers into
// contiguous stages over M workers so that the slowest stage is as fast as possible.
// Torch-free: the inputs are per-layer numbers from a profile, the output is split points.
#pragma once

#include <limits>
#include <string>
#include <vector>

namespace torchpp::plan {

// Per-layer measurements; every vector has one entry per layer (empty = all zero, except compute).
struct LayerCosts {
  std::vector<double> compute;                 // seconds for forward + backward of one microbatch
  std::vector<double> activation_bytes;        // output of layer l, sent to l+1 (its gradient returns)
  std::vector<double> parameter_bytes;         // weights whose gradients replicas all-reduce
  std::vector<double> state_bytes;             // resident per worker: weights + grads + optimizer state
  std::vector<double> saved_activation_bytes;  // kept alive from forward to backward, per microbatch
};

// Where chunk c of rank r sits when each rank holds several stages.
enum class Placement {
  kInterleaved,  // stage s on rank s % M (Megatron's interleaved 1F1B)
  kVShape,       // v = 2, stage s on rank s < M ? s : 2M-1-s (ZB-V: first and last stage share rank 0)
};

struct PartitionOptions {
  int num_workers = 1;  // M
  // Bytes per second between consecutive stages; infinity makes sends free.
  double activation_bandwidth = std::numeric_limits<double>::infinity();
  // PipeDream's hybrid: a stage may run on r > 1 data-parallel replicas.
  bool allow_replication = false;
  int max_replicas = 0;  // 0 = up to num_workers
  // Bytes per second of the ring all-reduce that syncs a replicated stage's gradients.
  double sync_bandwidth = std::numeric_limits<double>::infinity();
  // Memory-aware mode: no worker may hold more than this many bytes.
  double memory_budget = std::numeric_limits<double>::infinity();
  // Peak in-flight microbatches per stage position (from the schedule simulator); empty = 1 each.
  std::vector<double> inflight;
  int num_chunks = 1;  // v stages per rank; > 1 turns on the chunked search
  Placement placement = Placement::kInterleaved;
};

struct Partition {
  std::vector<int> boundaries;      // S+1 layer indices; stage k holds [boundaries[k], boundaries[k+1])
  std::vector<int> replicas;        // workers per stage
  std::vector<int> stage_rank;      // first worker (rank) of each stage
  std::vector<double> stage_time;   // max(compute, gradient sync) / replicas
  std::vector<double> stage_memory; // bytes per worker of the stage
  std::vector<double> rank_time;    // per rank: sum of its stages' times
  std::vector<double> rank_memory;  // per rank: sum of its stages' memory
  double comm_time = 0.0;           // slowest boundary: 2 x activation send time
  double bottleneck = 0.0;          // the objective: max(slowest rank, comm_time)
};

// Solves exactly; throws std::invalid_argument on bad input or when nothing fits the budget.
Partition partition(const LayerCosts& costs, const PartitionOptions& options);

// Objective of a given split (same model as partition()), for checks and brute force.
Partition evaluate(const LayerCosts& costs, const PartitionOptions& options,
                   const std::vector<int>& boundaries, const std::vector<int>& replicas);

}  // namespace torchpp::plan
