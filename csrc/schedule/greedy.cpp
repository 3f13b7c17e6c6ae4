#include "schedule/greedy.h"

#include <algorithm>
#include <cmath>
#include <deque>
#include <limits>
#include <queue>

#include "schedule/errors.h"

namespace torchpp::schedule::detail {

namespace {

constexpr double kNever = std::numeric_limits<double>::infinity();
constexpr double kEps = 1e-9;

class ListScheduler {
 public:
  ListScheduler(Schedule& s, const Costs& costs, const GreedyPolicy& policy)
      : s_(s), costs_(costs), policy_(policy), p_(s.num_ranks), m_(s.num_microbatches),
        f_end_(s.num_stages, std::vector<double>(m_, -1)),
        i_end_(s.num_stages, std::vector<double>(m_, -1)),
        next_f_(s.num_stages, 0), next_i_(s.num_stages, 0),
        free_at_(p_, 0.0), bubble_(p_, 0.0), memory_(p_, 0.0), held_(p_, 0), cap_(p_),
        started_(p_, false), pending_w_(p_), stages_(p_) {
    int most = static_cast<int>(std::floor(policy.memory_limit / policy.memory.activation + kEps));
    for (int r = 0; r < p_; r++) {
      stages_[r] = s.stages_of_rank(r);
      remaining_ += static_cast<long>(stages_[r].size()) * m_ * 3;
      cap_[r] = std::max(1, most - policy.activation_taper * r);
    }
  }

  void run() {
    double now = 0.0;
    while (remaining_ > 0) {
      for (int r = 0; r < p_; r++) {
        if (free_at_[r] <= now + kEps) try_start(r, now);
      }
      while (!events_.empty() && events_.top() <= now + kEps) events_.pop();
      if (remaining_ == 0) break;
      if (events_.empty()) {
        throw ScheduleError("greedy scheduler stuck at time " + std::to_string(now) +
                            " (memory limit " + std::to_string(policy_.memory_limit) + ")");
      }
      now = events_.top();
    }
  }

 private:
  double comm_from(int stage, int rank) const {
    return s_.stage_to_rank[stage] != rank ? costs_.comm : 0.0;
  }
  // When the next F of `stage` can start: kNever if unknown yet, -1 if none left.
  double forward_ready(int stage, int rank) const {
    int mb = next_f_[stage];
    if (mb >= m_) return -1;
    int prev = s_.prev_stage(stage);
    if (prev < 0) return 0.0;
    double end = f_end_[prev][mb];
    return end < 0 ? kNever : end + comm_from(prev, rank);
  }
  double backward_ready(int stage, int rank) const {
    int mb = next_i_[stage];
    if (mb >= m_) return -1;
    if (mb >= next_f_[stage]) return kNever;
    double ready = f_end_[stage][mb];
    int next = s_.next_stage(stage);
    if (next >= 0) {
      double end = i_end_[next][mb];
      if (end < 0) return kNever;
      ready = std::max(ready, end + comm_from(next, rank));
    }
    return ready;
  }

  // Stages of rank r deeper than `stage` with forwards left and no activation held: without
  // room for their next F, a rank full of shallower activations waits for itself.
  int deeper_stages_waiting(int r, int stage) const {
    int waiting = 0;
    for (int st : stages_[r]) waiting += st > stage && next_f_[st] < m_ && next_f_[st] == next_i_[st];
    return waiting;
  }

  // Whether rank r stays within the memory limit after a change of `delta`.
  bool fits(int r, double delta) const { return memory_[r] + delta <= policy_.memory_limit + kEps; }
  double change(ActionType type) const {
    const MemoryUnits& u = policy_.memory;
    return type == ActionType::F ? u.activation : type == ActionType::I ? u.weight_pending - u.activation
                                                                        : -u.weight_pending;
  }

  // Bubbles only grow: the two largest are kept as they change, for the short-gap rule.
  void add_bubble(int r, double idle) {
    bubble_[r] += idle;
    if (r == worst_) return;
    if (bubble_[r] > bubble_[worst_]) {
      runner_up_ = worst_;
      worst_ = r;
    } else if (runner_up_ < 0 || bubble_[r] > bubble_[runner_up_]) {
      runner_up_ = r;
    }
  }
  double worst_bubble_besides(int r) const {
    int q = r == worst_ ? runner_up_ : worst_;
    return q < 0 ? 0.0 : bubble_[q];
  }

  void emit(int r, double now, Action a) {
    double cost = costs_.cost(a.type, a.stage);
    memory_[r] += change(a.type);
    if (started_[r]) add_bubble(r, now - free_at_[r]);
    started_[r] = true;
    s_.actions[r].push_back(a);
    free_at_[r] = now + cost;
    events_.push(now + cost);
    if (costs_.comm > 0) events_.push(now + cost + costs_.comm);
    remaining_--;
  }

  void try_start(int r, double now) {
    if (static_cast<int>(pending_w_[r].size()) >= policy_.max_pending_weights) {
      Action w = pending_w_[r].front();  // weight-gradient memory is full: free some first
      pending_w_[r].pop_front();
      emit(r, now, w);
      return;
    }
    // Candidate backward (I): earliest ready, then oldest microbatch, then deepest stage.
    int i_stage = -1;
    double i_ready = kNever, i_known = kNever;
    for (int st : stages_[r]) {
      double t = backward_ready(st, r);
      if (t < 0) continue;
      i_known = std::min(i_known, t);
      if (t <= now + kEps && (i_stage < 0 || t < i_ready - kEps ||
                              (t <= i_ready + kEps && next_i_[st] <= next_i_[i_stage]))) {
        i_stage = st;
        i_ready = t;
      }
    }
    if (i_stage >= 0 && !fits(r, change(ActionType::I))) {
      // M_W > M_B: the I itself needs room; without a W to free some, this setting is stuck
      if (pending_w_[r].empty()) return;
      Action w = pending_w_[r].front();
      pending_w_[r].pop_front();
      emit(r, now, w);
      return;
    }
    if (i_stage >= 0) {
      int mb = next_i_[i_stage]++;
      emit(r, now, {i_stage, ActionType::I, mb});
      i_end_[i_stage][mb] = free_at_[r];
      held_[r]--;
      pending_w_[r].push_back({i_stage, ActionType::W, mb});
      return;
    }
    // Candidate forward: deepest ready stage, within the memory limit and the rank's
    // activation cap (the taper); a W frees memory, not activations. Where M_W > M_B the F
    // leaves room for its I too, so a rank never holds activations it cannot backpropagate.
    double room = std::max(policy_.memory.activation, policy_.memory.weight_pending);
    bool memory_full = !fits(r, room), room_reserved = false;
    bool capped = held_[r] >= cap_[r];
    int f_stage = -1;
    double f_known = kNever;
    bool forwards_left = false;
    for (int st : stages_[r]) {
      double t = forward_ready(st, r);
      if (t < 0) continue;
      forwards_left = true;
      if (memory_full || capped) continue;
      if (policy_.reserve_deeper_stages && !fits(r, room + policy_.memory.activation * deeper_stages_waiting(r, st))) {
        room_reserved = true;
        continue;
      }
      f_known = std::min(f_known, t);
      if (t <= now + kEps && (f_stage < 0 || st > f_stage)) f_stage = st;
    }
    auto& pending = pending_w_[r];
    bool forward_withheld = false;
    if (f_stage >= 0) {
      bool delays_backward = i_known < now + costs_.cost(ActionType::F, f_stage) - kEps;
      int next = s_.next_stage(f_stage);
      bool ahead = next >= 0 && next_f_[f_stage] - next_f_[next] > 1;
      bool skip = policy_.skip_forward_when_ahead && ahead && !pending.empty();
      if (skip) {  // a W now costs no bubble: the next stage has work queued anyway
        Action w = pending.front();
        pending.pop_front();
        emit(r, now, w);
        return;
      }
      forward_withheld = delays_backward && !policy_.forward_may_delay_backward;
      if (!forward_withheld) {
        int mb = next_f_[f_stage]++;
        emit(r, now, {f_stage, ActionType::F, mb});
        f_end_[f_stage][mb] = free_at_[r];
        held_[r]++;
        return;
      }
    }
    if (pending.empty()) return;
    bool backwards_left = false;
    for (int st : stages_[r]) backwards_left |= next_i_[st] < m_;
    double gap = (forward_withheld ? i_known : std::min(i_known, f_known)) - now;
    bool fill = memory_full || room_reserved || (!forwards_left && !backwards_left) ||
                gap >= costs_.cost(ActionType::W, pending.front().stage) - kEps;
    if (!fill && policy_.weight_fills_short_gaps) {
      fill = bubble_[r] + gap >= worst_bubble_besides(r);
    }
    if (!fill) return;
    Action w = pending.front();
    pending.pop_front();
    emit(r, now, w);
  }

  Schedule& s_;
  const Costs& costs_;
  const GreedyPolicy& policy_;
  const int p_, m_;
  std::vector<std::vector<double>> f_end_, i_end_;
  std::vector<int> next_f_, next_i_;
  std::vector<double> free_at_, bubble_, memory_;
  std::vector<int> held_, cap_;
  int worst_ = 0, runner_up_ = -1;  // ranks with the largest and second largest bubble
  std::vector<bool> started_;
  std::vector<std::deque<Action>> pending_w_;
  std::vector<std::vector<int>> stages_;
  std::priority_queue<double, std::vector<double>, std::greater<double>> events_;
  long remaining_ = 0;
};

}  // namespace

Schedule greedy_schedule(Schedule skeleton, const Costs& costs, const GreedyPolicy& policy) {
  ListScheduler(skeleton, costs, policy).run();
  return skeleton;
}

}  // namespace torchpp::schedule::detail
