#include "runtime/executor.h"

#include <algorithm>
#include <chrono>
#include <optional>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>  // at::NoGradGuard: not through ATen.h on torch 2.11
#include <ATen/record_function.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "ops/pass_groups.h"
#include "ops/split_linear_store.h"

namespace torchpp::runtime {

using schedule::Action;
using schedule::ActionType;

namespace {

// How long a failing rank waits for the step-start vote to complete before breaking its groups.
constexpr auto kVoteSettle = std::chrono::seconds(5);

std::vector<Action> parse_actions(const std::vector<std::string>& texts) {
  std::vector<Action> actions;
  actions.reserve(texts.size());
  for (const auto& text : texts) {
    try {
      actions.push_back(Action::parse(text));
    } catch (const std::exception& error) {
      TORCH_CHECK(false, "torchpp pipeline: cannot parse action '", text, "': ", error.what());
    }
  }
  return actions;
}

}  // namespace

Executor::Executor(ExecutorConfig config, ForwardFn forward, BackwardHook after_backward)
    : config_(std::move(config)),
      forward_fn_(std::move(forward)),
      after_backward_(std::move(after_backward)),
      actions_(parse_actions(config_.actions)),
      partner_(overlap_partners()),
      channel_(config_.pp_group, config_.tp_group, config_.tp_rank, config_.tp_size, config_.scatter_gather,
               config_.in_order, config_.device, config_.timeout, config_.fingerprint),
      failure_(config_.pp_group, config_.abort_groups),
      timeline_(config_.device),
      forward_only_(std::none_of(actions_.begin(), actions_.end(), [](const Action& a) {
        return a.type == ActionType::B || a.type == ActionType::I || a.type == ActionType::W;
      })) {
  TORCH_CHECK(!config_.overlap_forward_backward || config_.device.type() == c10::DeviceType::CPU,
              "torchpp pipeline: forward-backward overlap runs the two passes in two threads, which on ",
              config_.device, " would need the autograd engine's device threads to know their pass; it is CPU-only");
  TORCH_CHECK(config_.stages_per_pipeline > 0, "torchpp pipeline: stages_per_pipeline must be positive");
  TORCH_CHECK(config_.backward_hooked_stages.empty() || after_backward_,
              "torchpp pipeline: backward_hooked_stages needs an after_backward hook");
  for (const auto& action : actions_) {
    TORCH_CHECK(action.stage >= 0 && action.stage < static_cast<int>(config_.stage_to_rank.size()),
                "torchpp pipeline: action ", action.str(), " names a stage outside the schedule");
  }
}

Executor::~Executor() = default;

void Executor::step(bool inputs_changed) {
  const Action* current = nullptr;
  try {
    reset_step_state();
    timeline_.begin_step();
    vote_ = channel_.post_vote(first_step_ || inputs_changed, step_kind());
    std::optional<at::NoGradGuard> no_grad;  // an evaluation step records no graph
    if (forward_only_) no_grad.emplace();
    for (size_t i = 0; i < actions_.size(); ++i) {
      const Action& action = actions_[i];
      current = &action;
      if (partner_[i] >= 0) {
        run_overlapped(i, static_cast<size_t>(partner_[i]));
        i = static_cast<size_t>(partner_[i]);
        continue;
      }
      const bool compute = schedule::is_compute(action.type);
      current_record_ = timeline_.start(action.str(), compute);
      run(action);
      timeline_.end(current_record_);
    }
    current = nullptr;
    exchange_meta();  // a rank that never needed the answer still completes the vote
    for (auto& entry : activation_sends_) channel_.finish_send(entry.second);
    for (auto& send : other_sends_) channel_.finish_send(send);
    TORCH_INTERNAL_ASSERT(saved_.empty(), "torchpp pipeline: ", saved_.size(),
                          " microbatch-stages were never run backward (schedule incomplete)");
    timeline_.finish_step();
    failure_.raise_if_peer_failed(config_.rank);
    first_step_ = false;
  } catch (const std::exception& error) {
    fail_step(error, current ? "action " + current->str() : std::string("the step boundary"));
  }
}

void Executor::abort_step(const std::string& message) {
  // Take part in the step-start vote the peers are (or will be) waiting on, then fail as if
  // the first action had raised.
  reset_step_state();
  try {
    vote_ = channel_.post_vote(true, step_kind());
  } catch (const std::exception&) {
    // The group is broken already: no vote is left to join.
  }
  fail_step(PipelineFailure(FailureKind::Generic, message), "the start of its step");
}

void Executor::fail_step(const std::exception& error, const std::string& where) {
  // Complete this rank's part of the step-start vote before the group is broken: a peer
  // blocked on that all-reduce is not woken by the break (bounded, in case the peer is gone).
  if (vote_.work) {
    try {
      vote_.work->wait(kVoteSettle);
    } catch (const std::exception&) {
      // The vote failed or timed out; breaking the group below is what is left to do.
    }
  }
  weight_grad_store::clear();
  reset_step_state();
  first_step_ = true;
  if (shared_failure_) {  // run_overlapped shared it with the peers already
    std::exception_ptr shared = shared_failure_;
    shared_failure_ = nullptr;
    std::rethrow_exception(shared);
  }
  failure_.fail(error, config_.rank, where);
}

bool Executor::exchange_meta() {
  if (vote_.work) {
    const auto vote = channel_.read_vote(vote_);
    exchange_meta_ = vote.exchange_meta;
    TORCH_CHECK(vote.same_kind, "torchpp pipeline: rank ", config_.rank, " runs ",
                forward_only_ ? "eval()" : "step()", " while another rank of the pipeline runs ",
                forward_only_ ? "step()" : "eval()", "; every rank must call the same one");
    if (!vote.disagreements.empty()) {
      throw PipelineFailure(FailureKind::Config, "torchpp pipeline: " + channel_.disagreement_message(vote.disagreements));
    }
  }
  return exchange_meta_;
}

void Executor::reset_step_state() {
  vote_ = PendingRecv{};
  saved_.clear();
  local_activations_.clear();
  input_grads_.clear();
  local_gradients_.clear();
  activation_recvs_.clear();
  activation_headers_.clear();
  gradient_recvs_.clear();
  activation_sends_.clear();
  other_sends_.clear();
  peak_activations_ = 0;
}

void Executor::run(const Action& action) {
  // Every rank reads the step-start vote before its first message, so a disagreement found
  // there stops every rank before any of them could wait on a message.
  if (!schedule::is_compute(action.type)) exchange_meta();
  switch (action.type) {
    case ActionType::F:
    case ActionType::I:
    case ActionType::B:
    case ActionType::W: {
      Work work = prepare(action);
      compute(work);
      finish(work);
      break;
    }
    case ActionType::SEND_F:
      send_forward(action);
      break;
    case ActionType::SEND_B:
      send_backward(action);
      break;
    case ActionType::RECV_F:
      post_recv_forward(action);
      break;
    case ActionType::RECV_B:
      post_recv_backward(action);
      break;
  }
}

// ---- Compute ----  (sends and receives: executor_transfers.cpp)

Executor::Work Executor::prepare(const Action& action) {
  Work work;
  work.action = action;
  work.record = current_record_;
  const Key key{action.stage, action.microbatch};
  if (action.type == ActionType::F) {
    if (!is_first(action.stage)) {
      work.inputs = take_activation(action);
      for (auto& input : work.inputs) {
        // Leaves, so that I/B can read the gradients the previous stage needs.
        input = input.detach();
        if (!forward_only_ && carries_gradient(input.scalar_type())) input.requires_grad_(true);
      }
    }
    return work;
  }
  if (action.type == ActionType::W) return work;
  auto it = saved_.find(key);
  TORCH_CHECK(it != saved_.end(), "torchpp pipeline: ", action.str(), " runs before its forward");
  Saved saved = std::move(it->second);
  saved_.erase(it);  // the activations go as soon as this backward has run
  work.inputs = std::move(saved.inputs);
  work.outputs = std::move(saved.outputs);
  if (is_last(action.stage)) {
    if (work.outputs[0].requires_grad()) work.roots.push_back(work.outputs[0]);  // the loss
    return work;
  }
  // One gradient per output that carries one; outputs that need none (detached) skip theirs.
  const Tensors grads = take_gradient(action);
  size_t next = 0;
  for (const auto& output : work.outputs) {
    if (!carries_gradient(output.scalar_type())) continue;
    const at::Tensor& grad = grads.at(next++);
    if (output.requires_grad()) {
      work.roots.push_back(output);
      work.grad_outputs.push_back(grad);
    }
  }
  return work;
}

void Executor::compute(Work& work) {
  const Action& action = work.action;
  PassGuard pass(action.type == ActionType::F ? Pass::Forward : Pass::Backward);
  // A profiler span per compute action (with its thread: overlapped pairs run in two).
  RECORD_FUNCTION(std::string("torchpp::pipeline::") + schedule::action_type_name(action.type),
                  std::vector<c10::IValue>());
  if (action.type == ActionType::W) {
    weight_grad_store::run(action.stage, action.microbatch);
    return;
  }
  if (action.type == ActionType::F) {
    try {
      work.outputs = forward_fn_(action.stage, action.microbatch, work.inputs);
    } catch (const c10::DistError&) {
      throw;  // a broken group: the failure path looks for the peer that broke it
    } catch (const std::exception& error) {
      if (work.inputs.empty()) throw;
      // What the stage was given tells a wrong shape from the previous stage (e.g. another hidden size).
      auto* failure = dynamic_cast<const PipelineFailure*>(&error);
      throw PipelineFailure(failure ? failure->kind() : FailureKind::Generic,
                            std::string(error.what()) + " (stage " + std::to_string(action.stage) +
                                "'s input from stage " + std::to_string(action.stage - 1) + " was " +
                                MessageMeta::of(work.inputs).str() + ")");
    }
    TORCH_CHECK(!work.outputs.empty() && std::all_of(work.outputs.begin(), work.outputs.end(),
                                                     [](const at::Tensor& t) { return t.defined(); }),
                "stage ", action.stage, " returned no tensor for microbatch ", action.microbatch);
    TORCH_CHECK(!is_last(action.stage) || forward_only_ || work.outputs.size() == 1,
                "torchpp pipeline: the last stage's callback must return its loss alone");
    return;
  }
  const bool split = action.type == ActionType::I;
  const bool hooked = config_.backward_hooked_stages.count(action.stage) > 0;
  if (!work.roots.empty() || hooked) {
    if (split) weight_grad_store::begin_capture(action.stage, action.microbatch);
    try {
      if (!work.roots.empty()) {
        torch::autograd::backward(work.roots, work.grad_outputs, /*retain_graph=*/false, /*create_graph=*/false);
      }
      // Still capturing: what the hook defers runs in this microbatch's W.
      if (hooked) after_backward_(action.stage, action.microbatch, split);
    } catch (...) {
      if (split) weight_grad_store::end_capture();
      throw;
    }
    if (split) weight_grad_store::end_capture();
  }
  work.roots.clear();
  work.grad_outputs.clear();
  if (!is_first(action.stage)) {
    for (const auto& input : work.inputs) {
      if (!carries_gradient(input.scalar_type())) continue;
      at::Tensor grad = input.grad();
      work.input_grads.push_back(grad.defined() ? grad : at::zeros_like(input));
    }
  }
}

void Executor::finish(Work& work) {
  const Action& action = work.action;
  const Key key{action.stage, action.microbatch};
  if (action.type == ActionType::W) return;
  if (action.type == ActionType::F) {
    auto expected = config_.expected_outputs.find(action.stage);
    if (expected != config_.expected_outputs.end() && !is_last(action.stage) && exchange_meta()) {
      // Checked where shapes travel: in other steps a changed output fails send_forward.
      check_expected(MessageMeta::of(work.outputs), expected->second, action.stage, action.microbatch, "returned", "",
                     "output_args");
    }
    const bool next_is_local = !is_last(action.stage) && rank_of(action.stage + 1) == config_.rank;
    if (next_is_local) {
      Tensors handed;
      for (const auto& output : work.outputs) handed.push_back(output.detach());
      local_activations_[{action.stage + 1, action.microbatch}] = std::move(handed);
    }
    if (!forward_only_) {
      saved_[key] = Saved{std::move(work.inputs), std::move(work.outputs)};
    } else if (!is_last(action.stage) && !next_is_local) {
      saved_[key] = Saved{{}, std::move(work.outputs)};  // no backward will come: kept only until SEND_F
    }
    peak_activations_ = std::max<int64_t>(peak_activations_, static_cast<int64_t>(saved_.size()));
    return;
  }
  if (!is_first(action.stage)) {
    if (rank_of(action.stage - 1) == config_.rank) {
      local_gradients_[{action.stage - 1, action.microbatch}] = std::move(work.input_grads);
    } else {
      input_grads_[key] = std::move(work.input_grads);
    }
  }
  // The next stage consumed this microbatch's activation before sending its gradient back.
  auto sent = activation_sends_.find(key);
  if (sent != activation_sends_.end()) {
    channel_.finish_send(sent->second);
    activation_sends_.erase(sent);
  }
}

}  // namespace torchpp::runtime
