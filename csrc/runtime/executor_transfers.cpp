// The executor's transfers (executor.h): posting sends and receives of activations and
// gradients, and handing received tensors to the action that consumes them.
#include "runtime/executor.h"

#include <optional>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

namespace torchpp::runtime {

using schedule::Action;
using schedule::ActionType;

namespace {

[[noreturn]] void shape_error(const std::string& message) {
  throw PipelineFailure(FailureKind::Shape, "PipelineShapeError: " + message);
}

// What a stage on this rank handed over directly for `key` (no transfer), taken out of `local`.
template <typename Map, typename Key>
std::optional<typename Map::mapped_type> take_local(Map& local, const Key& key) {
  auto found = local.find(key);
  if (found == local.end()) return std::nullopt;
  auto value = std::move(found->second);
  local.erase(found);
  return value;
}

}  // namespace

// ---- Sends ----

void Executor::send_forward(const Action& action) {
  const Key key{action.stage, action.microbatch};
  const auto& outputs = saved_.at(key).outputs;
  const MessageMeta meta = MessageMeta::of(outputs);
  const int dst = rank_of(action.stage + 1);
  const MessageTag data{Direction::Forward, action.stage + 1, action.microbatch, false};
  if (exchange_meta()) {
    other_sends_.push_back(channel_.send_header(meta, dst, {Direction::Forward, action.stage + 1, action.microbatch, true}));
    sent_meta_[key] = meta;
  } else {
    auto known = sent_meta_.find(key);
    if (known == sent_meta_.end() || known->second != meta) {
      shape_error("stage " + std::to_string(action.stage) + " microbatch " + std::to_string(action.microbatch) +
                  " produced an output of " + meta.str() + " but stage " + std::to_string(action.stage + 1) +
                  " was told to expect " + (known == sent_meta_.end() ? std::string("nothing") : known->second.str()) +
                  "; shapes may change only between steps whose input shapes differ");
    }
  }
  activation_sends_[key] = channel_.send(outputs, dst, data);
  if (forward_only_) saved_.erase(key);  // the pending send holds the buffer until it completes
}

void Executor::send_backward(const Action& action) {
  const Key key{action.stage, action.microbatch};
  auto it = input_grads_.find(key);
  TORCH_CHECK(it != input_grads_.end(), "torchpp pipeline: ", action.str(), " has no input gradient to send");
  if (!it->second.empty()) {  // inputs of integer dtypes only: no gradient travels
    other_sends_.push_back(channel_.send(it->second, rank_of(action.stage - 1),
                                         {Direction::Backward, action.stage - 1, action.microbatch, false}));
  }
  input_grads_.erase(it);
}

// ---- Receives ----

void Executor::post_recv_forward(const Action& action) {
  const Key key{action.stage, action.microbatch};
  const int src = rank_of(action.stage - 1);
  if (exchange_meta()) {
    activation_headers_[key] = channel_.post_header(src, {Direction::Forward, action.stage, action.microbatch, true});
    // In order, the data receive must follow its header right here, as the sender's send does.
    if (config_.in_order) receive_header(key, src);
    return;
  }
  auto known = received_meta_.find(key);
  TORCH_CHECK(known != received_meta_.end(), "torchpp pipeline: no metadata for ", action.str());
  activation_recvs_[key] = channel_.post(known->second, src, {Direction::Forward, action.stage, action.microbatch, false});
}

MessageMeta Executor::gradient_meta(const Key& key) const {
  auto saved = saved_.find(key);
  if (saved != saved_.end()) return MessageMeta::of(saved->second.outputs).gradients();
  // saved_ no longer holds the output once this stage's backward started; the send cached it.
  auto sent = sent_meta_.find(key);
  TORCH_CHECK(sent != sent_meta_.end(), "torchpp pipeline: no output metadata for stage ", key.first,
              " microbatch ", key.second);
  return sent->second.gradients();
}

void Executor::post_recv_backward(const Action& action) {
  const Key key{action.stage, action.microbatch};
  // The gradient has the shapes of this stage's outputs; post now if those are known already.
  if (!saved_.count(key) && (exchange_meta() || !sent_meta_.count(key))) {
    // In-order lowering places every RECV_B after its forward, which fixes the gradient's size.
    TORCH_CHECK(!config_.in_order, "torchpp pipeline: ", action.str(), " comes before its forward in an in-order schedule");
    return;  // posted by the consumer once the forward has run
  }
  const MessageMeta meta = gradient_meta(key);
  if (meta.empty()) return;  // outputs of integer dtypes only: no gradient comes back
  gradient_recvs_[key] =
      channel_.post(meta, rank_of(action.stage + 1), {Direction::Backward, action.stage, action.microbatch, false});
}

void Executor::receive_header(const Key& key, int src) {
  auto header = activation_headers_.find(key);
  MessageMeta meta = channel_.finish_header(header->second);
  activation_headers_.erase(header);
  auto expected = config_.expected_inputs.find(key.first);
  if (expected != config_.expected_inputs.end()) {
    check_expected(meta, expected->second, key.first, key.second, "received",
                   "from stage " + std::to_string(key.first - 1), "input_args");
  }
  received_meta_[key] = meta;
  activation_recvs_[key] = channel_.post(meta, src, {Direction::Forward, key.first, key.second, false});
}

Tensors Executor::take_activation(const Action& consumer) {
  const Key key{consumer.stage, consumer.microbatch};
  if (auto local = take_local(local_activations_, key)) return std::move(*local);
  const Action recv_action{consumer.stage, ActionType::RECV_F, consumer.microbatch};
  if (activation_headers_.count(key)) receive_header(key, rank_of(consumer.stage - 1));
  auto recv = activation_recvs_.find(key);
  TORCH_CHECK(recv != activation_recvs_.end(), "torchpp pipeline: ", consumer.str(),
              " needs an activation that no RECV_F posted (schedule not lowered?)");
  Tensors inputs = channel_.finish(recv->second, received_meta_.at(key));
  activation_recvs_.erase(recv);
  timeline_.arrived(recv_action.str(), now_us());
  timeline_.restart(current_record_);
  return inputs;
}

Tensors Executor::take_gradient(const Action& consumer) {
  const Key key{consumer.stage, consumer.microbatch};
  if (auto local = take_local(local_gradients_, key)) return std::move(*local);
  const MessageMeta meta = gradient_meta(key);
  if (meta.empty()) return {};
  auto recv = gradient_recvs_.find(key);
  const Action recv_action{consumer.stage, ActionType::RECV_B, consumer.microbatch};
  if (recv == gradient_recvs_.end()) {
    TORCH_CHECK(!config_.in_order, "torchpp pipeline: ", consumer.str(), " has no RECV_B before it in an in-order schedule");
    recv = gradient_recvs_.emplace(key, channel_.post(meta, rank_of(consumer.stage + 1),
                                                      {Direction::Backward, consumer.stage, consumer.microbatch, false}))
               .first;
  }
  Tensors grads = channel_.finish(recv->second, meta);
  gradient_recvs_.erase(recv);
  timeline_.arrived(recv_action.str(), now_us());
  timeline_.restart(current_record_);
  return grads;
}

}  // namespace torchpp::runtime
