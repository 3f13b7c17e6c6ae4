// v chunks per rank: a rank runs all its stages, so its load is the sum of non-adjacent
// stages and PipeDream's prefix DP no longer decomposes. Exact branch and bound instead:
// stages are cut left to right, a branch dies once it cannot beat the best split found.
#include <algorithm>
#include <limits>
#include <stdexcept>
#include <string>
#include <unordered_map>

#include "plan/solvers.h"

namespace torchpp::plan {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

class ChunkedSearch {
 public:
  ChunkedSearch(const StageCosts& costs, const PartitionOptions& options)
      : costs_(costs),
        n_(costs.num_layers()),
        m_(options.num_workers),
        s_(options.num_workers * options.num_chunks),
        load_(m_, 0.0),
        memory_(m_, 0.0),
        ends_(s_, 0) {
    for (int s = 0; s < s_; ++s) rank_.push_back(rank_of_stage(s, m_, options.num_chunks, options.placement));
    // Ranks that still receive a stage after stage s: the remaining work can only go there.
    later_ranks_.resize(s_);
    for (int s = 0; s < s_; ++s) {
      std::vector<bool> seen(m_, false);
      for (int t = s + 1; t < s_; ++t) {
        if (!seen[rank_[t]]) later_ranks_[s].push_back(rank_[t]);
        seen[rank_[t]] = true;
      }
    }
    for (int s = 0; s < s_; ++s) target_.push_back(balanced_end(s));
  }

  Split run() {
    visit(0, 0, 0.0);
    if (best_ == kInf) {
      throw std::invalid_argument("no split of " + std::to_string(n_) + " layers into " + std::to_string(s_) +
                                  " chunked stages over " + std::to_string(m_) + " ranks fits the memory budget");
    }
    Split split;
    split.boundaries.push_back(0);
    split.boundaries.insert(split.boundaries.end(), best_ends_.begin(), best_ends_.end());
    split.replicas.assign(s_, 1);
    return split;
  }

 private:
  // Where stage s would end if every stage took an equal share of compute: tried first.
  int balanced_end(int s) const {
    const double share = costs_.compute(0, n_) * (s + 1) / s_;
    int end = 1;
    while (end < n_ && costs_.compute(0, end) < share) ++end;
    return end;
  }

  void visit(int s, int begin, double worst) {
    if (s == s_) {
      if (worst < best_) {
        best_ = worst;
        best_ends_ = ends_;
      }
      return;
    }
    const int rank = rank_[s];
    if (s > 0 && rank_[s - 1] != rank) worst = std::max(worst, costs_.comm(begin));
    if (worst >= best_ || seen_no_better(s, begin, worst)) return;
    // The last stage takes every remaining layer; earlier ones leave one per later stage.
    const int first = s == s_ - 1 ? n_ : begin + 1, last = s == s_ - 1 ? n_ : n_ - (s_ - s - 1);
    const int pivot = std::clamp(target_[s], first, last);
    // Upwards from the balanced cut a longer stage only costs more: stop at the first loser.
    for (int end = pivot; end <= last; ++end) {
      if (!try_stage(s, begin, end, worst)) break;
    }
    for (int end = pivot - 1; end >= first; --end) try_stage(s, begin, end, worst);
  }

  // True when an earlier visit reached the same stage, cut and loads of the ranks still to be
  // filled with no higher worst: everything it could reach was explored then. Ties in costs
  // (equal transformer blocks) make such repeats the common case.
  bool seen_no_better(int s, int begin, double worst) {
    key_.assign({static_cast<double>(s), static_cast<double>(begin)});
    if (s > 0) {
      for (int r : later_ranks_[s - 1]) key_.push_back(load_[r]);
      for (int r : later_ranks_[s - 1]) key_.push_back(memory_[r]);
    }
    auto [it, inserted] = visited_.try_emplace(key_, worst);
    if (inserted) return false;
    if (it->second <= worst) return true;
    it->second = worst;
    return false;
  }

  struct KeyHash {
    size_t operator()(const std::vector<double>& key) const {
      size_t h = key.size();
      for (double x : key) h = h * 1000003u ^ std::hash<double>()(x);
      return h;
    }
  };

  // Places stage s on [begin, end); false when this or any longer stage cannot win.
  bool try_stage(int s, int begin, int end, double worst) {
    const int rank = rank_[s];
    const double load = load_[rank] + costs_.compute(begin, end);
    const double memory = memory_[rank] + costs_.memory(begin, end, costs_.inflight(s));
    if (load >= best_ || !costs_.fits(memory)) return false;
    if (lower_bound(s, rank, load, end) >= best_) return true;
    const double saved_load = load_[rank], saved_memory = memory_[rank];
    load_[rank] = load;
    memory_[rank] = memory;
    ends_[s] = end;
    visit(s + 1, end, std::max(worst, load));
    load_[rank] = saved_load;
    memory_[rank] = saved_memory;
    return true;
  }

  // Water-filling bound: the remaining work, poured into the ranks that still get a stage,
  // cannot leave the slowest of them below the level it would reach if layers were divisible.
  double lower_bound(int s, int rank, double load, int end) {
    const auto& ranks = later_ranks_[s];
    if (ranks.empty()) return 0.0;
    levels_.clear();
    for (int r : ranks) levels_.push_back(r == rank ? load : load_[r]);
    std::sort(levels_.begin(), levels_.end());
    double water = costs_.compute(end, n_), filled = 0.0;
    for (size_t k = 0; k < levels_.size(); ++k) {
      filled += levels_[k];
      const double level = (filled + water) / (k + 1);
      if (k + 1 == levels_.size() || level <= levels_[k + 1]) return level;
    }
    return levels_.back();
  }

  const StageCosts& costs_;
  const int n_, m_, s_;
  std::vector<int> rank_;
  std::vector<std::vector<int>> later_ranks_;
  std::vector<int> target_;
  std::vector<double> load_, memory_;
  std::vector<double> levels_;  // scratch for lower_bound
  std::vector<double> key_;     // scratch for seen_no_better
  std::unordered_map<std::vector<double>, double, KeyHash> visited_;
  std::vector<int> ends_, best_ends_;
  double best_ = kInf;
};

}  // namespace

Split solve_chunked(const StageCosts& costs, const PartitionOptions& options) {
  const int stages = options.num_workers * options.num_chunks;
  if (costs.num_layers() < stages) {
    throw std::invalid_argument("cannot split " + std::to_string(costs.num_layers()) + " layers into " +
                                std::to_string(stages) + " stages (" + std::to_string(options.num_workers) +
                                " ranks x " + std::to_string(options.num_chunks) + " chunks)");
  }
  return ChunkedSearch(costs, options).run();
}

}  // namespace torchpp::plan
