// The pipeline executor: runs this rank's lowered action list (F, I, W, B, SEND/RECV) of a
// schedule from the schedule compiler, once per training step (or, given a forward-only list,
// once per evaluation step, without autograd).
//
//  - F calls back into the stage module (Python or any callable) with the received inputs
//    (one tensor or several: a stage may pass a tuple to the next, whose gradient message
//    then holds the gradients of its floating-point entries);
//    I and B run autograd in C++; I captures split-B/W linears' weight gradients under
//    (stage, microbatch) in the weight-gradient store and W runs them.
//  - A microbatch's saved activations and output are dropped as soon as its I/B has run.
//  - Receives are posted at their RECV action (or, a gradient whose size is not known yet, once
//    its forward has run) and waited on only by the consuming action; sends never block. In
//    order (NCCL: matched by order, sends may wait for their receive): every message is issued
//    exactly at its SEND/RECV action, headers included, so the schedule's in-order lowering
//    decides the order on both ranks of a pair.
//  - Shapes/dtypes travel as a header before the data in steps where they may have changed
//    (the first step, and steps whose input shapes changed); otherwise the cached ones are used
//    and a stage output that disagrees raises PipelineShapeError.
//  - Every step starts with a vote over the pipeline group (one small all-reduce, overlapped)
//    that also compares the schedule fingerprint (fingerprint.h): ranks that built different
//    schedules all raise PipelineConfigError before any message could hang.
//  - Every blocking wait is bounded (bounded_wait.h): a peer that never answers (stopped, hung)
//    fails the step with PipelineTimeoutError naming the action and the peer.
//  - Any failure aborts the step on every rank (see failure.h).
//  - Forward-backward overlap (DualPipe's, `overlap_forward_backward`): a forward and the
//    backward of another microbatch next to it in the list (only the first one's sends and
//    receives between them) run at once, the first in a worker thread; while one waits on a
//    collective (expert parallelism's all-to-all) the other computes. The backward's collectives
//    go to twin groups (ops/pass_groups.h); messages keep their order (receives between the two
//    are issued while the first runs, its sends after both).
#pragma once

#include <chrono>
#include <exception>
#include <functional>
#include <map>
#include <set>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "runtime/failure.h"
#include "runtime/fingerprint.h"
#include "runtime/p2p_channel.h"
#include "runtime/tensor_meta.h"
#include "runtime/timeline.h"
#include "schedule/ir.h"

namespace torchpp::runtime {

// (stage, microbatch, inputs) -> outputs; the inputs are empty on a first stage (the callback
// owns the step's inputs) and the output of a last stage is its (scaled) loss alone.
using ForwardFn = std::function<Tensors(int64_t, int64_t, const Tensors&)>;
// (stage, microbatch, split): runs right after that microbatch's backward on the stages of
// backward_hooked_stages (torch's dw_builder); split: an I pass, whose weight-gradient capture
// is still open, so work the hook defers into the store runs at the microbatch's W.
using BackwardHook = std::function<void(int64_t, int64_t, bool)>;

struct ExecutorConfig {
  int rank = 0;                      // this rank in the pipeline group
  std::vector<std::string> actions;  // this rank's lowered actions, e.g. "0F3", "1RECV_B0"
  std::vector<int> stage_to_rank;
  int stages_per_pipeline = 1;
  std::string pp_group;
  std::string tp_group;  // used by scatter/gather only
  int64_t tp_rank = 0;
  int64_t tp_size = 1;
  bool scatter_gather = false;
  bool in_order = false;  // actions come from lower_in_order; issue messages exactly there
  std::vector<std::string> abort_groups;  // groups to abort when a step fails
  c10::Device device = c10::Device(c10::DeviceType::CPU);
  std::map<int, MessageMeta> expected_inputs;   // user-given input metadata per stage
  std::map<int, MessageMeta> expected_outputs;  // the same for outputs (not of last stages: pre-loss)
  std::set<int> backward_hooked_stages;         // stages whose backward calls the BackwardHook
  std::chrono::milliseconds timeout{0};         // longest wait on a peer (zero: the group's own)
  Fingerprint fingerprint;                      // what every rank's schedule must agree on
  bool overlap_forward_backward = false;        // run F/B pairs at once (CPU only, see above)
};

class Executor {
 public:
  Executor(ExecutorConfig config, ForwardFn forward, BackwardHook after_backward = nullptr);
  ~Executor();  // out of line: members hold c10d types this header only declares

  // Runs one step. `inputs_changed`: this rank's step inputs differ in shape from the last step.
  void step(bool inputs_changed);
  // Fails the step this rank cannot start (its inputs were rejected) on every rank, as a
  // failing action would, so peers already in the step raise instead of waiting; raises the
  // PipelineFailure carrying `message`.
  [[noreturn]] void abort_step(const std::string& message);

  const Timeline& timeline() const { return timeline_; }
  // Most microbatch-stages alive (between F and I/B) at once in the last step.
  int64_t peak_activations() const { return peak_activations_; }

 private:
  using Key = std::pair<int, int>;  // (stage, microbatch)
  struct Saved {
    Tensors inputs;
    Tensors outputs;
  };

  // A compute action around its work: prepare (main thread: inputs, bookkeeping), compute (the
  // work itself, any thread), finish (main thread: files the results).
  struct Work {
    schedule::Action action;
    Tensors inputs;        // F: the received inputs; I/B: the forward's saved inputs
    Tensors outputs;       // F: what the stage returned; I/B: the forward's outputs
    Tensors roots;         // I/B: outputs that get a gradient, and those gradients
    Tensors grad_outputs;
    Tensors input_grads;   // I/B: the gradients of the inputs, for the previous stage
    size_t record = 0;     // timeline record
  };

  [[noreturn]] void fail_step(const std::exception& error, const std::string& where);
  // What fail_step does to the peers (shares the error, breaks the groups), without throwing:
  // the PipelineFailure to raise once the other thread of an overlapped pair has returned.
  std::exception_ptr share_failure(const std::exception& error, const std::string& where) noexcept;
  void run(const schedule::Action& action);
  Work prepare(const schedule::Action& action);
  void compute(Work& work);
  void finish(Work& work);
  // Runs actions_[first] and actions_[second] at once, with the messages between them.
  void run_overlapped(size_t first, size_t second);
  // For each action index, the index of the action it runs at once with (-1: none).
  std::vector<int> overlap_partners() const;
  void send_forward(const schedule::Action& action);
  void send_backward(const schedule::Action& action);
  void post_recv_forward(const schedule::Action& action);
  void post_recv_backward(const schedule::Action& action);
  // Waits for the header of (stage, microbatch)'s activation and posts the data receive.
  void receive_header(const Key& key, int src);
  Tensors take_activation(const schedule::Action& consumer);
  Tensors take_gradient(const schedule::Action& consumer);
  // The gradient message `key`'s forward output gets back (empty: nothing travels).
  MessageMeta gradient_meta(const Key& key) const;
  void reset_step_state();
  // Whether headers travel this step: every rank must agree, so a tiny all-reduce decides. It
  // runs from the step's start and is read before this rank's first message, so the first
  // stage's first forward overlaps it instead of waiting a collective's latency. It also
  // raises if ranks disagree on step() against eval(), or on the schedule fingerprint, before
  // any message could hang.
  bool exchange_meta();

  int step_kind() const { return forward_only_ ? 1 : 0; }  // what the step-start vote compares
  bool is_first(int stage) const { return stage % config_.stages_per_pipeline == 0; }
  bool is_last(int stage) const { return stage % config_.stages_per_pipeline == config_.stages_per_pipeline - 1; }
  int rank_of(int stage) const { return config_.stage_to_rank.at(stage); }

  ExecutorConfig config_;
  ForwardFn forward_fn_;
  BackwardHook after_backward_;
  std::vector<schedule::Action> actions_;
  std::vector<int> partner_;  // overlap_partners()
  P2PChannel channel_;
  FailurePropagation failure_;
  Timeline timeline_;
  bool forward_only_;  // an evaluation list (F, SEND_F, RECV_F only): no graph, nothing kept for backward
  bool first_step_ = true;
  bool exchange_meta_ = true;  // valid once vote_ has been read
  PendingRecv vote_;
  std::exception_ptr shared_failure_;  // already shared with the peers by run_overlapped

  std::map<Key, Saved> saved_;
  std::map<Key, Tensors> local_activations_;  // next stage on this rank: handed over directly
  std::map<Key, Tensors> input_grads_;        // produced by I/B, awaiting SEND_B
  std::map<Key, Tensors> local_gradients_;    // previous stage on this rank: keyed by its (stage, mb)
  std::map<Key, PendingRecv> activation_recvs_;  // keyed by consumer (stage, microbatch)
  std::map<Key, PendingRecv> activation_headers_;
  std::map<Key, PendingRecv> gradient_recvs_;
  std::map<Key, PendingSend> activation_sends_;  // reaped once the microbatch's backward ran
  std::vector<PendingSend> other_sends_;         // headers and gradients: waited at step end
  std::map<Key, MessageMeta> received_meta_;     // per consumer (stage, microbatch), across steps
  std::map<Key, MessageMeta> sent_meta_;         // per producer (stage, microbatch), across steps
  int64_t peak_activations_ = 0;
  size_t current_record_ = 0;  // timeline record of the running action
};

}  // namespace torchpp::runtime
