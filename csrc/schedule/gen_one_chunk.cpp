// gpipe, 1f1b, eager-1f1b, zb-h1, zb-h2: one stage per rank (stage r on rank r).
#include <algorithm>
#include <deque>
#include <numeric>

#include "schedule/generators_impl.h"

namespace torchpp::schedule::detail {

namespace {

struct RankPlan {
  int warmup_forwards;  // forwards before the first backward
  bool split_backward;  // I + W (zero bubble) instead of the fused B
  int weight_lag;       // W's held back: a W runs once more than this many are pending
};

template <typename PlanOf>
Schedule build(const char* name, int p, int m, PlanOf plan_of) {
  std::vector<int> placement(p);
  std::iota(placement.begin(), placement.end(), 0);
  Schedule s = make_schedule(name, p, m, placement);
  for (int r = 0; r < p; r++) {
    RankPlan plan = plan_of(r);
    auto& out = s.actions[r];
    int nf = 0, nb = 0;
    std::deque<int> pending_w;
    auto forward = [&]() { out.push_back({r, ActionType::F, nf++}); };
    auto backward = [&]() {
      if (!plan.split_backward) {
        out.push_back({r, ActionType::B, nb++});
        return;
      }
      out.push_back({r, ActionType::I, nb});
      pending_w.push_back(nb++);
      while (static_cast<int>(pending_w.size()) > plan.weight_lag) {
        out.push_back({r, ActionType::W, pending_w.front()});
        pending_w.pop_front();
      }
    };
    for (int k = std::min(plan.warmup_forwards, m); k > 0; k--) forward();
    while (nf < m) {  // steady state: one forward, one backward
      forward();
      backward();
    }
    while (nb < m) backward();  // cooldown
    for (int mb : pending_w) out.push_back({r, ActionType::W, mb});
  }
  return s;
}

}  // namespace

Schedule gpipe(int p, int m) {
  return build("gpipe", p, m, [&](int) { return RankPlan{m, false, 0}; });
}

Schedule one_f_one_b(int p, int m) {
  return build("1f1b", p, m, [&](int r) { return RankPlan{p - 1 - r, false, 0}; });
}

// Twice the warm-up of 1F1B, so each forward's send overlaps the next forward (Paddle).
Schedule eager_one_f_one_b(int p, int m) {
  return build("eager-1f1b", p, m, [&](int r) { return RankPlan{2 * (p - 1 - r), false, 0}; });
}

// 1F1B with B split into I and W; rank r defers r W's into its cooldown bubble.
Schedule zb_h1(int p, int m) {
  return build("zb-h1", p, m, [&](int r) { return RankPlan{p - 1 - r, true, r}; });
}

// More warm-up forwards (2p-1 in flight on rank 0) and 2r deferred W's: a parallelogram.
Schedule zb_h2(int p, int m) {
  return build("zb-h2", p, m, [&](int r) { return RankPlan{2 * (p - 1 - r), true, 2 * r}; });
}

}  // namespace torchpp::schedule::detail
