// What each compute action waits for, shared by lowering, validation, simulation and the
// greedy scheduler so that all of them agree with the runtime's data flow (see ir.h).
#pragma once

#include "schedule/ir.h"

namespace torchpp::schedule {

// The three results a (stage, microbatch) produces: its forward output, its input gradient
// (from I or from the fused B) and its weight gradient (from W or B).
enum class Pass : int { Forward = 0, InputGrad = 1, WeightGrad = 2 };

inline Pass pass_of(ActionType type) {
  switch (type) {
    case ActionType::F: return Pass::Forward;
    case ActionType::W: return Pass::WeightGrad;
    default: return Pass::InputGrad;  // I and B both release the input gradient
  }
}

// Dense index over (stage, microbatch, pass) for O(1) lookups.
struct PassIndex {
  int num_microbatches;
  int num_stages;
  int size() const { return num_stages * num_microbatches * 3; }
  int key(int stage, int microbatch, Pass pass) const {
    return (stage * num_microbatches + microbatch) * 3 + static_cast<int>(pass);
  }
};

struct Dependency {
  int stage;
  int microbatch;
  Pass pass;
};

// The passes compute action `a` consumes; returns how many were written to `out` (at most 2).
inline int dependencies(const Schedule& s, const Action& a, Dependency out[2]) {
  int n = 0;
  switch (a.type) {
    case ActionType::F:
      if (s.prev_stage(a.stage) >= 0) out[n++] = {s.prev_stage(a.stage), a.microbatch, Pass::Forward};
      break;
    case ActionType::I:
    case ActionType::B:
      out[n++] = {a.stage, a.microbatch, Pass::Forward};
      if (s.next_stage(a.stage) >= 0) out[n++] = {s.next_stage(a.stage), a.microbatch, Pass::InputGrad};
      break;
    case ActionType::W:
      out[n++] = {a.stage, a.microbatch, Pass::InputGrad};
      break;
    default:
      break;
  }
  return n;
}

// The RECV compute action `a` needs on `rank` when its input comes from a stage on another
// rank (`src`); false when the input is local or there is none.
inline bool needed_recv(const Schedule& s, int rank, const Action& a, Action& recv, int& src) {
  if (a.type == ActionType::F && s.prev_stage(a.stage) >= 0) {
    src = s.stage_to_rank[s.prev_stage(a.stage)];
    recv = {a.stage, ActionType::RECV_F, a.microbatch};
  } else if ((a.type == ActionType::I || a.type == ActionType::B) && s.next_stage(a.stage) >= 0) {
    src = s.stage_to_rank[s.next_stage(a.stage)];
    recv = {a.stage, ActionType::RECV_B, a.microbatch};
  } else {
    return false;
  }
  return src != rank;
}

}  // namespace torchpp::schedule
