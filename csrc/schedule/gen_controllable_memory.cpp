// v-min and v-half: the controllable-memory V schedules of Qi et al. 2024 ("Pipeline Parallelism
// with Controllable Memory", SPEC.md section 13), built from a repeating building block.
//
// Rank r holds stages r and 2p-1-r (the V). On a grid of unit slots (F = I = W = one slot) a
// building block gives each rank the slot of its four passes of microbatch 0: the forward down
// the V (stage r), the forward back up (stage 2p-1-r), then the two input gradients in reverse.
// Microbatch k repeats the block 6k slots later (a rank's six passes per microbatch); the two
// slots a rank has left in each period take its W's, first pending first. The offsets between
// neighbouring ranks on each leg set every stage's lifespan (its F to its W), and the lifespans
// set peak memory: V-Min steps one slot per rank on every leg, V-Half two slots on the legs
// that run down the ranks. The repeated blocks leave idle slots in warm-up and cool-down; a
// compaction then moves each pass to the earliest free slot its inputs allow, as long as the
// rank's memory (activations from F to W, as the paper counts them) stays within the block's
// peak, so the steady state and its memory stay those of the block.
#include <algorithm>
#include <array>
#include <vector>

#include "schedule/errors.h"
#include "schedule/generators_impl.h"

namespace torchpp::schedule::detail {

namespace {

constexpr int kPeriod = 6;  // slots per microbatch on a rank: F, F, I, I, W, W

// Slots of rank r's passes of microbatch 0: F on stage r, F on stage 2p-1-r, I on stage
// 2p-1-r, I on stage r. `down` is the offset per rank on the legs that run from rank 0 to
// rank p-1 (the first forward leg, the first backward leg) and at the backward's turn on rank
// p-1; the legs back step one slot per rank.
std::array<int, 4> block_slots(int p, int r, int down, int gap) {
  int f_first = down * r;
  int f_second = down * (p - 1) + 1 + (p - 1 - r);  // stage p starts on rank p-1 after stage p-1
  int i_second = down * (p - 1) + p + 1 + gap + down * r;  // after rank 0's last forward
  int i_first = i_second - down * r + down * (p - 1) + down + (p - 1 - r);
  return {f_first, f_second, i_second, i_first};
}

// The smallest extra gap before the backward legs that puts a rank's four passes in distinct
// slots of the period on every rank (so that blocks of consecutive microbatches interleave).
int block_gap(int p, int down) {
  for (int gap = 0; gap < kPeriod; gap++) {
    bool distinct = true;
    for (int r = 0; r < p && distinct; r++) {
      auto slots = block_slots(p, r, down, gap);
      std::array<bool, kPeriod> used{};
      for (int s : slots) {
        if (used[s % kPeriod]) distinct = false;
        used[s % kPeriod] = true;
      }
    }
    if (distinct) return gap;
  }
  throw ScheduleError("controllable-memory V: no building block for p=" + std::to_string(p));
}

struct Placed {
  Action action;
  int rank;
  int block_slot;  // where the repeated building block puts it
  int slot = -1;   // where the compaction puts it
};

class BlockSchedule {
 public:
  BlockSchedule(int p, int m, int down)
      : p_(p), m_(m), stages_(2 * p), slot_of_(2 * p * m * 3, -1) {
    int gap = block_gap(p, down);
    int horizon = 0;
    for (int r = 0; r < p; r++) {
      auto slots = block_slots(p, r, down, gap);
      const int stage_of[4] = {r, 2 * p - 1 - r, 2 * p - 1 - r, r};
      for (int k = 0; k < m; k++) {
        for (int j = 0; j < 4; j++) {
          ActionType type = j < 2 ? ActionType::F : ActionType::I;
          passes_.push_back({{stage_of[j], type, k}, r, slots[j] + kPeriod * k});
          horizon = std::max(horizon, slots[j] + kPeriod * k + 1);
        }
      }
    }
    place_weight_passes(horizon);
  }

  // Moves every pass, in block order, to the earliest free slot its inputs allow within the
  // memory of the repeated block; returns the schedule in that order.
  Schedule compact(const char* name) {
    std::sort(passes_.begin(), passes_.end(), [](const Placed& a, const Placed& b) {
      return a.block_slot != b.block_slot ? a.block_slot < b.block_slot : a.rank < b.rank;
    });
    int horizon = 0;
    for (const Placed& x : passes_) horizon = std::max(horizon, x.block_slot + 1);
    occupied_.assign(p_, std::vector<char>(horizon, 0));
    memory_.assign(p_, std::vector<int>(horizon + 1, 0));
    budget_ = block_peak(horizon);
    for (Placed& x : passes_) place(x);

    std::vector<int> placement(2 * p_);
    for (int s = 0; s < 2 * p_; s++) placement[s] = s < p_ ? s : 2 * p_ - 1 - s;
    Schedule out = make_schedule(name, p_, m_, placement);
    std::vector<const Placed*> order;
    for (const Placed& x : passes_) order.push_back(&x);
    std::sort(order.begin(), order.end(), [](const Placed* a, const Placed* b) { return a->slot < b->slot; });
    for (const Placed* x : order) out.actions[x->rank].push_back(x->action);
    return out;
  }

 private:
  int key(const Action& a) const {
    int pass = a.type == ActionType::F ? 0 : a.type == ActionType::I ? 1 : 2;
    return (a.stage * m_ + a.microbatch) * 3 + pass;
  }

  // W's go to the slots the block leaves free, oldest I first; the rest after the last pass.
  void place_weight_passes(int horizon) {
    std::vector<std::vector<char>> taken(p_, std::vector<char>(horizon, 0));
    std::vector<std::vector<std::pair<int, Action>>> backward(p_);  // per rank: (slot, I)
    for (const Placed& x : passes_) {
      taken[x.rank][x.block_slot] = 1;
      if (x.action.type == ActionType::I) backward[x.rank].push_back({x.block_slot, x.action});
    }
    std::vector<Placed> weights;
    for (int r = 0; r < p_; r++) {
      auto& mine = backward[r];
      std::sort(mine.begin(), mine.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
      size_t next_i = 0, next_w = 0;
      for (int t = 0; next_w < mine.size(); t++) {
        while (next_i < mine.size() && mine[next_i].first < t) next_i++;
        if (t < horizon && taken[r][t]) continue;
        if (next_w < next_i) {
          Action w = mine[next_w++].second;
          w.type = ActionType::W;
          weights.push_back({w, r, t});
        }
      }
    }
    passes_.insert(passes_.end(), weights.begin(), weights.end());
  }

  // Memory on the grid as the paper counts it: an F holds one activation from its slot until
  // the end of its W's slot.
  void add_memory(int rank, int from, int to, int delta) {
    for (int t = from; t < to; t++) memory_[rank][t] += delta;
  }

  int block_peak(int horizon) {
    std::vector<std::vector<int>> held(p_, std::vector<int>(horizon + 1, 0));
    int peak = 0;
    for (const Placed& x : passes_) {
      if (x.action.type == ActionType::F) held[x.rank][x.block_slot] += 1;
      if (x.action.type == ActionType::W) held[x.rank][x.block_slot + 1] -= 1;
    }
    for (auto& row : held) {
      int now = 0;
      for (int v : row) peak = std::max(peak, now += v);
    }
    return peak;
  }

  // The earliest slot x may take: after every pass it consumes (F of the previous stage, the
  // next stage's I, its own F or I) and after its predecessor of the same stage and kind.
  int earliest(const Placed& x) const {
    const Action& a = x.action;
    int ready = 0;
    auto after = [&](int stage, ActionType type, int mb) {
      if (stage < 0 || stage >= stages_ || mb < 0) return;
      int slot = slot_of_[key({stage, type, mb})];
      if (slot < 0) throw ScheduleError("controllable-memory V: " + a.str() + " placed before its input");
      ready = std::max(ready, slot + 1);
    };
    switch (a.type) {
      case ActionType::F: after(a.stage - 1, ActionType::F, a.microbatch); break;
      case ActionType::I:
        after(a.stage, ActionType::F, a.microbatch);
        if (a.stage + 1 < stages_) after(a.stage + 1, ActionType::I, a.microbatch);
        break;
      default: after(a.stage, ActionType::I, a.microbatch); break;
    }
    if (a.microbatch > 0) after(a.stage, a.type, a.microbatch - 1);
    return ready;
  }

  void place(Placed& x) {
    auto& free_slot = occupied_[x.rank];
    auto& mem = memory_[x.rank];
    int from = earliest(x), slot = x.block_slot;
    if (x.action.type == ActionType::F) {
      // Earlier slots raise memory on [slot, block_slot): scan down while that stays in budget.
      int worst = 0;
      for (int t = x.block_slot - 1; t >= from; t--) {
        worst = std::max(worst, mem[t]);
        if (worst + 1 > budget_) break;
        if (!free_slot[t]) slot = t;
      }
    } else {
      for (int t = from; t < x.block_slot; t++) {
        if (!free_slot[t]) {
          slot = t;
          break;
        }
      }
    }
    if (free_slot[slot]) throw ScheduleError("controllable-memory V: slot " + std::to_string(slot) + " taken twice");
    free_slot[slot] = 1;
    x.slot = slot;
    slot_of_[key(x.action)] = slot;
    if (x.action.type == ActionType::F) add_memory(x.rank, slot, static_cast<int>(mem.size()), 1);
    if (x.action.type == ActionType::W) add_memory(x.rank, slot + 1, static_cast<int>(mem.size()), -1);
  }

  const int p_, m_, stages_;
  std::vector<Placed> passes_;
  std::vector<int> slot_of_;
  std::vector<std::vector<char>> occupied_;
  std::vector<std::vector<int>> memory_;
  int budget_ = 0;
};

}  // namespace

Schedule v_min(int p, int m) { return BlockSchedule(p, m, 1).compact("v-min"); }

Schedule v_half(int p, int m) { return BlockSchedule(p, m, 2).compact("v-half"); }

}  // namespace torchpp::schedule::detail
