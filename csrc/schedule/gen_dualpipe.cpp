// DualPipe and DualPipeV (DeepSeek-V3): the eight-step per-rank program of SPEC.md section 3.
// Each rank runs two "phases": phase 0 is the stage it holds in the first half of its
// pipeline, phase 1 the other one. Both generators share that program; only the placement
// differs (see ir.h: DualPipe has two pipelines with duplicated parameters, DualPipeV one
// pipeline of 2p stages in V shape).
#include <algorithm>
#include <deque>

#include "schedule/generators_impl.h"

namespace torchpp::schedule::detail {

namespace {

struct Phase {
  int stage;
  int first_microbatch;  // global index of this phase's microbatch 0
  int forwards = 0;
  int backwards = 0;
};

class RankProgram {
 public:
  RankProgram(std::vector<Action>& out, Phase phase0, Phase phase1) : out_(out), phases_{phase0, phase1} {}

  void forward(int phase) {
    Phase& ph = phases_[phase];
    out_.push_back({ph.stage, ActionType::F, ph.first_microbatch + ph.forwards++});
  }
  // zero_bubble: I now, W deferred to the queue; otherwise the fused B.
  void backward(int phase, bool zero_bubble = false) {
    Phase& ph = phases_[phase];
    int mb = ph.first_microbatch + ph.backwards++;
    if (!zero_bubble) {
      out_.push_back({ph.stage, ActionType::B, mb});
      return;
    }
    out_.push_back({ph.stage, ActionType::I, mb});
    deferred_.push_back({ph.stage, ActionType::W, mb});
  }
  void weight() {
    if (deferred_.empty()) return;
    out_.push_back(deferred_.front());
    deferred_.pop_front();
  }
  bool weights_pending() const { return !deferred_.empty(); }

 private:
  std::vector<Action>& out_;
  Phase phases_[2];
  std::deque<Action> deferred_;
};

// half_ranks: ranks per half of the fold (p/2 for DualPipe, p for DualPipeV);
// half_rank: distance from the rank's pipeline entry; chunks: microbatches per phase.
void eight_steps(RankProgram& rank, int half_ranks, int half_rank, int chunks) {
  const int outer = half_ranks - half_rank - 1;
  for (int i = 0; i < 2 * outer; i++) rank.forward(0);                        // 1: nF0
  for (int i = 0; i < half_rank + 1; i++) { rank.forward(0); rank.forward(1); }  // 2: nF0F1
  for (int i = 0; i < outer; i++) {                                           // 3: nB1W1F1
    rank.backward(1, true);
    rank.weight();
    rank.forward(1);
  }
  for (int i = 0; i < chunks - 2 * half_ranks + half_rank + 1; i++) {        // 4: nF0B1F1B0
    rank.forward(0);
    rank.backward(1);
    rank.forward(1);
    rank.backward(0);
  }
  for (int i = 0; i < outer; i++) {                                           // 5: nB1F1B0
    rank.backward(1);
    rank.forward(1);
    rank.backward(0);
  }
  bool zero_bubble = false;                                                   // 6: nB1B0
  for (int i = 0; i < half_rank + 1; i++) {
    if (i == (half_rank + 1) / 2 && half_rank % 2 == 1) zero_bubble = true;
    rank.backward(1, zero_bubble);
    if (i == (half_rank + 1) / 2 && half_rank % 2 == 0) zero_bubble = true;
    rank.backward(0, zero_bubble);
  }
  for (int i = 0; i < outer; i++) {                                           // 7: nWB0
    rank.weight();
    rank.backward(0, true);
  }
  while (rank.weights_pending()) rank.weight();                               // 8: nW
}

}  // namespace

Schedule dualpipe(int p, int m) {
  std::vector<int> placement(2 * p);
  for (int s = 0; s < 2 * p; s++) placement[s] = s < p ? s : 2 * p - 1 - s;
  Schedule s = make_schedule("dualpipe", p, m, placement, /*num_pipelines=*/2);
  const int half = m / 2;
  for (int r = 0; r < p; r++) {
    Phase down{r, 0}, up{2 * p - 1 - r, half};  // pipeline 0 flows rank 0 -> p-1, pipeline 1 back
    bool second_half = r >= p / 2;
    RankProgram program(s.actions[r], second_half ? up : down, second_half ? down : up);
    eight_steps(program, p / 2, std::min(r, p - 1 - r), half);
  }
  return s;
}

Schedule dualpipe_v(int p, int m) {
  std::vector<int> placement(2 * p);
  for (int s = 0; s < 2 * p; s++) placement[s] = s < p ? s : 2 * p - 1 - s;
  Schedule s = make_schedule("dualpipe-v", p, m, placement);
  for (int r = 0; r < p; r++) {
    RankProgram program(s.actions[r], Phase{r, 0}, Phase{2 * p - 1 - r, 0});
    eight_steps(program, p, r, m);
  }
  return s;
}

}  // namespace torchpp::schedule::detail
