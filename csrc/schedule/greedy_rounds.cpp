// round_schedule (greedy.h): the zero-bubble paper's heuristic, microbatch by microbatch.
// Times and memory are summed and compared exactly as the paper's scheduler does (no
// tolerance), so the same costs give the same schedule, ties included.
#include <algorithm>
#include <vector>

#include "schedule/errors.h"
#include "schedule/greedy.h"

namespace torchpp::schedule::detail {

namespace {

class RoundScheduler {
 public:
  RoundScheduler(Schedule& s, const Costs& costs, const RoundPolicy& policy)
      : s_(s), costs_(costs), policy_(policy), p_(s.num_ranks), m_(s.num_microbatches),
        f_end_(p_, std::vector<double>(m_, 0.0)), i_end_(p_, std::vector<double>(m_, 0.0)),
        nf_(p_, 0), ni_(p_, 0), nw_(p_, 0), end_(p_, 0.0), memory_(p_, 0.0), bubble_(p_, 0.0) {}

  void run() {
    warm_up();
    for (int k = 1; k < m_; k++) {
      std::vector<bool> forward(p_);
      for (int r = 0; r < p_; r++) forward[r] = wants_forward(r);
      // A rank runs an F only where the next one does too, so F's never outrun the pipeline.
      for (int r = p_ - 2; r >= 0; r--) forward[r] = forward[r] && forward[r + 1];
      for (int r = 0; r < p_; r++) {
        if (!forward[r]) continue;
        make_room(r, ActionType::F);
        if (r > 0) fill_gap(r, f_end_[r - 1][nf_[r]] + costs_.comm);
        put(r, ActionType::F);
      }
      for (int r = p_ - 1; r >= 0; r--) {
        make_room(r, ActionType::I);
        if (r + 1 < p_) fill_gap(r, i_end_[r + 1][k] + costs_.comm);
        if (r == 0 && nf_[0] == m_) {
          while (nw_[0] < ni_[0]) put(0, ActionType::W);
        }
        put(r, ActionType::I);
      }
    }
    for (int r = 0; r < p_; r++) {
      while (nw_[r] < m_) put(r, ActionType::W);
    }
  }

 private:
  double cost(ActionType type, int r) const { return costs_.cost(type, r); }
  double change(ActionType type) const {
    const MemoryUnits& u = policy_.memory;
    return type == ActionType::F ? u.activation : type == ActionType::I ? u.weight_pending - u.activation
                                                                        : -u.weight_pending;
  }
  bool fits(double memory, ActionType type) const {
    return memory + change(type) <= policy_.memory_limit;
  }
  double max_bubble() const { return *std::max_element(bubble_.begin(), bubble_.end()); }

  // Appends the next action of `type` on rank r, timed as the simulator times it.
  void put(int r, ActionType type) {
    int mb = type == ActionType::F ? nf_[r]++ : type == ActionType::I ? ni_[r]++ : nw_[r]++;
    double c = cost(type, r), back_to_back = end_[r] + c, end = back_to_back;
    if (type == ActionType::F && r > 0) end = std::max(end, f_end_[r - 1][mb] + costs_.comm + c);
    if (type == ActionType::I && r + 1 < p_) end = std::max(end, i_end_[r + 1][mb] + costs_.comm + c);
    if (nf_[r] > 1 || type != ActionType::F) bubble_[r] += end - back_to_back;  // not the wait for F0
    end_[r] = end;
    if (type == ActionType::F) f_end_[r][mb] = end_[r];
    if (type == ActionType::I) i_end_[r][mb] = end_[r];
    memory_[r] += change(type);
    s_.actions[r].push_back({r, type, mb});
  }

  // W's until the next `type` fits the memory limit.
  void make_room(int r, ActionType type) {
    while (!fits(memory_[r], type)) {
      if (nw_[r] >= ni_[r]) {
        throw ScheduleError("round scheduler: rank " + std::to_string(r) + " has no W to free memory for its next " +
                            action_type_name(type));
      }
      put(r, ActionType::W);
    }
  }

  // Before an action whose input arrives at `arrival`: W's that end by then, and one more into
  // a shorter gap when the policy says so or when idling would make this rank's bubble the
  // largest.
  void fill_gap(int r, double arrival) {
    while (nw_[r] < ni_[r] && end_[r] + cost(ActionType::W, r) <= arrival) put(r, ActionType::W);
    if (nw_[r] < ni_[r] && end_[r] < arrival) {
      bool idle_is_affordable = arrival - end_[r] <= max_bubble() - bubble_[r];
      if (policy_.weight_fills_every_gap || !idle_is_affordable) put(r, ActionType::W);
    }
  }

  // Round 0: F0 on every rank, then from the last rank back, the F's that fit before I0 comes
  // back (within memory), tapered so that each rank runs fewer than the one before it.
  void warm_up() {
    for (int r = 0; r < p_; r++) put(r, ActionType::F);
    std::vector<int> extra(p_, 0);
    double back = f_end_[p_ - 1][0] + cost(ActionType::I, p_ - 1);  // I0 ends on the last rank
    for (int r = p_ - 2; r >= 0; r--) {
      double arrival = back + costs_.comm, t = end_[r], memory = memory_[r];
      while (nf_[r] + extra[r] < m_ && fits(memory, ActionType::F)) {
        double f = cost(ActionType::F, r);
        if (policy_.warmup_ends_before_backward ? t + f > arrival : t >= arrival) break;
        memory += change(ActionType::F);
        t += f;
        extra[r]++;
      }
      back = std::max(t, arrival) + cost(ActionType::I, r);
    }
    for (int r = 1; r < p_; r++) {
      while (extra[r] > 0 && extra[r] >= extra[r - 1] && nf_[r] + extra[r] < m_) extra[r]--;
    }
    for (int r = 0; r < p_; r++) {
      for (int k = 0; k < extra[r]; k++) put(r, ActionType::F);
    }
    for (int r = p_ - 1; r >= 0; r--) put(r, ActionType::I);
  }

  // Round k's F on rank r, unless the skip rule holds it back: two or more F's ahead of rank
  // r+1, it waits when its F (and the W's that make room for it) would not be done before
  // rank r+1 has run its next F and I anyway, and idling is affordable.
  bool wants_forward(int r) const {
    if (nf_[r] >= m_) return false;
    if (!policy_.skip_forward_when_ahead || r + 1 >= p_ || nf_[r] < nf_[r + 1] + 2) return true;
    double next_done = end_[r + 1] + cost(ActionType::F, r + 1) + cost(ActionType::I, r + 1) + costs_.comm;
    if (end_[r] >= next_done) return false;
    double memory = memory_[r] + change(ActionType::F), w_time = 0.0;
    for (int w = nw_[r]; memory > policy_.memory_limit && w < ni_[r]; w++) {
      memory += change(ActionType::W);
      w_time += cost(ActionType::W, r);
    }
    if (end_[r] + cost(ActionType::F, r) + w_time <= next_done) return true;
    return next_done - end_[r] > max_bubble() - bubble_[r];
  }

  Schedule& s_;
  const Costs& costs_;
  const RoundPolicy& policy_;
  const int p_, m_;
  std::vector<std::vector<double>> f_end_, i_end_;
  std::vector<int> nf_, ni_, nw_;
  std::vector<double> end_, memory_, bubble_;
};

}  // namespace

Schedule round_schedule(Schedule skeleton, const Costs& costs, const RoundPolicy& policy) {
  RoundScheduler(skeleton, costs, policy).run();
  return skeleton;
}

}  // namespace torchpp::schedule::detail
