// Pipeline schedule IR: what the schedule compiler emits and the runtime (csrc/runtime) executes.
// Torch-free on purpose: the compiler is unit-tested alone (tests/schedule/cpp).
//
// A Schedule is one ordered list of Actions per pipeline rank. An Action is
// {stage, type, microbatch}; its string form is torch.distributed.pipelining's
// "<stage><type><microbatch>" ("0F3", "1I0", "2W5", "3B1", "1SEND_F3", "2RECV_B0").
//
// Stages and placement
//   - stage_to_rank[s] is the only rank that runs stage s (its parameters live there).
//   - The stages form `num_pipelines` independent chains of stages_per_pipeline() stages each:
//     pipeline k is stages [k*S, (k+1)*S) with S = stages_per_pipeline(), data flows s -> s+1.
//     Pipeline k carries the microbatches [microbatch_begin(k), microbatch_end(k)).
//   - Single-chunk schedules: stage s on rank s. Interleaved (v chunks): stage c*p + r on rank r.
//     V shape (zb-v, dualpipe-v): rank r holds stages r and 2p-1-r.
//   - DualPipe (num_pipelines == 2): pipeline 0 = stages 0..p-1 flowing rank 0 -> p-1 and
//     carrying microbatches [0, m/2); pipeline 1 = stages p..2p-1 flowing rank p-1 -> 0 and
//     carrying [m/2, m). Stage p+k runs on rank p-1-k (so rank r again holds r and 2p-1-r) and
//     holds a duplicate of the parameters of model stage k = model_stage(p+k): the runtime must
//     sum the gradients of stages k and p+k (they live on ranks k and p-1-k) before the step.
//
// Execution semantics (the simulator and the validator assume exactly these)
//   - A rank runs its actions in order, one compute action at a time.
//   - F(s, mb) consumes the output of F(prev(s), mb); I/B(s, mb) consumes F(s, mb) and the input
//     gradient of I/B(next(s), mb); W(s, mb) follows I(s, mb). B = I + W fused.
//   - Lowered schedules: SEND_F(s, mb) follows F(s, mb) and ships its output to stage s+1;
//     SEND_B(s, mb) follows I/B(s, mb) and ships the input gradient to stage s-1.
//     RECV_F(s, mb) / RECV_B(s, mb) name the consuming stage s. Sends and receives are
//     non-blocking (isend/irecv): a RECV only posts the receive, the consuming compute action
//     waits for it. On every ordered pair of ranks the receives are posted in the same order as
//     the sends (FIFO), so tensors can never cross; a RECV may therefore come well before its
//     consumer.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace torchpp::schedule {

enum class ActionType : uint8_t { F, I, W, B, SEND_F, RECV_F, SEND_B, RECV_B };

// "F", "I", "W", "B", "SEND_F", ... exactly as torch.distributed.pipelining spells them.
const char* action_type_name(ActionType type);
bool is_compute(ActionType type);

struct Action {
  int stage = 0;
  ActionType type = ActionType::F;
  int microbatch = 0;

  // "<stage><type><microbatch>", e.g. "0F3", "1SEND_F3".
  std::string str() const;
  // Inverse of str(); throws std::invalid_argument on anything else.
  static Action parse(const std::string& text);

  bool operator==(const Action& other) const {
    return stage == other.stage && type == other.type && microbatch == other.microbatch;
  }
  bool operator!=(const Action& other) const { return !(*this == other); }
};

struct Schedule {
  std::string name;
  int num_ranks = 0;
  int num_stages = 0;
  int num_microbatches = 0;
  int num_pipelines = 1;
  std::vector<int> stage_to_rank;
  // Per rank, in execution order. Compute actions only unless `lowered`.
  std::vector<std::vector<Action>> actions;
  bool lowered = false;

  int stages_per_pipeline() const { return num_stages / num_pipelines; }
  int pipeline_of_stage(int stage) const { return stage / stages_per_pipeline(); }
  // Stage whose parameters `stage` holds (differs from `stage` only for DualPipe's pipeline 1).
  int model_stage(int stage) const { return stage % stages_per_pipeline(); }
  bool is_first_stage(int stage) const { return stage % stages_per_pipeline() == 0; }
  bool is_last_stage(int stage) const { return stage % stages_per_pipeline() == stages_per_pipeline() - 1; }
  // -1 at the ends of a pipeline.
  int prev_stage(int stage) const { return is_first_stage(stage) ? -1 : stage - 1; }
  int next_stage(int stage) const { return is_last_stage(stage) ? -1 : stage + 1; }
  int microbatch_begin(int pipeline) const { return pipeline * num_microbatches / num_pipelines; }
  int microbatch_end(int pipeline) const { return (pipeline + 1) * num_microbatches / num_pipelines; }
  std::vector<int> stages_of_rank(int rank) const;

  // Per rank, the action strings.
  std::vector<std::string> action_strings(int rank) const;
};

// Empty schedule with its placement set and one empty action list per rank.
Schedule make_schedule(std::string name, int num_ranks, int num_microbatches,
                       std::vector<int> stage_to_rank, int num_pipelines = 1);

}  // namespace torchpp::schedule
