#include "plan/stage_costs.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

namespace torchpp::plan {
namespace {

void require(bool ok, const std::string& message) {
  if (!ok) throw std::invalid_argument(message);
}

std::vector<double> prefix_sums(const std::vector<double>& values, int n, const char* name) {
  require(values.empty() || static_cast<int>(values.size()) == n,
          std::string(name) + " has " + std::to_string(values.size()) + " entries, expected " +
              std::to_string(n) + " (one per layer) or none");
  std::vector<double> sums(n + 1, 0.0);
  for (int l = 0; l < static_cast<int>(values.size()); ++l) {
    require(std::isfinite(values[l]) && values[l] >= 0.0,
            std::string(name) + "[" + std::to_string(l) + "] must be finite and >= 0, got " +
                std::to_string(values[l]));
    sums[l + 1] = sums[l] + values[l];
  }
  return sums;
}

}  // namespace

StageCosts::StageCosts(const LayerCosts& costs, const PartitionOptions& options)
    : num_layers_(static_cast<int>(costs.compute.size())),
      sync_bandwidth_(options.sync_bandwidth),
      budget_(options.memory_budget) {
  require(num_layers_ > 0, "compute must list at least one layer");
  require(options.num_workers >= 1, "num_workers must be >= 1, got " + std::to_string(options.num_workers));
  require(options.activation_bandwidth > 0.0, "activation_bandwidth must be > 0 (infinity = free sends)");
  require(options.sync_bandwidth > 0.0, "sync_bandwidth must be > 0 (infinity = free gradient sync)");
  require(options.memory_budget > 0.0, "memory_budget must be > 0 (infinity = unlimited)");
  compute_ = prefix_sums(costs.compute, num_layers_, "compute");
  params_ = prefix_sums(costs.parameter_bytes, num_layers_, "parameter_bytes");
  state_ = prefix_sums(costs.state_bytes, num_layers_, "state_bytes");
  saved_ = prefix_sums(costs.saved_activation_bytes, num_layers_, "saved_activation_bytes");
  std::vector<double> sent = prefix_sums(costs.activation_bytes, num_layers_, "activation_bytes");
  send_seconds_.resize(num_layers_);
  for (int l = 0; l < num_layers_; ++l) send_seconds_[l] = (sent[l + 1] - sent[l]) / options.activation_bandwidth;
  for (double count : options.inflight) {
    require(std::isfinite(count) && count >= 0.0, "inflight counts must be finite and >= 0");
  }
  inflight_ = options.inflight;
}

double StageCosts::time(int begin, int end, int replicas) const {
  const double work = compute(begin, end);
  if (replicas == 1) return work;
  // Ring all-reduce moves 2(r-1)/r of the gradient bytes per replica (SPEC section 5).
  const double sync = 2.0 * (replicas - 1) / replicas * (params_[end] - params_[begin]) / sync_bandwidth_;
  return std::max(work, sync) / replicas;
}

double StageCosts::comm(int boundary) const {
  if (boundary <= 0 || boundary >= num_layers_) return 0.0;
  return 2.0 * send_seconds_[boundary - 1];
}

double StageCosts::memory(int begin, int end, double inflight) const {
  return (state_[end] - state_[begin]) + (saved_[end] - saved_[begin]) * inflight;
}

double StageCosts::inflight(int position) const {
  if (inflight_.empty()) return 1.0;
  return inflight_.at(position);
}

int rank_of_stage(int stage, int num_workers, int num_chunks, Placement placement) {
  if (num_chunks == 1 || placement == Placement::kInterleaved) return stage % num_workers;
  return stage < num_workers ? stage : 2 * num_workers - 1 - stage;
}

}  // namespace torchpp::plan
