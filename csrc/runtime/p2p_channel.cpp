#include "runtime/p2p_channel.h"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "ops/p2p.h"
#include "ops/process_group.h"
#include "runtime/message_buffer.h"

namespace torchpp::runtime {
namespace {

constexpr int kMaxMicrobatches = 1 << 16;

}  // namespace

std::string MessageTag::str() const {
  const std::string what = direction == Direction::Forward ? "the activation for stage " : "the gradient for stage ";
  return (header ? "the shape header of " : "") + what + std::to_string(consumer_stage) + " microbatch " +
         std::to_string(microbatch);
}

int MessageTag::value() const {
  TORCH_CHECK(microbatch < kMaxMicrobatches, "torchpp pipeline: at most ", kMaxMicrobatches, " microbatches");
  return (((consumer_stage * 2 + static_cast<int>(direction)) * 2 + (header ? 1 : 0)) * kMaxMicrobatches) + microbatch;
}

P2PChannel::P2PChannel(const std::string& group_name, std::string tp_group_name, int64_t tp_rank, int64_t tp_size,
                       bool scatter_gather, bool in_order, c10::Device device, std::chrono::milliseconds timeout,
                       Fingerprint fingerprint)
    : group_(resolve_group(group_name)),
      in_order_(in_order),
      tp_group_name_(std::move(tp_group_name)),
      tp_rank_(scatter_gather ? tp_rank : 0),
      tp_size_(scatter_gather ? tp_size : 1),
      device_(device),
      vote_bound_(wait_bound(timeout, *group_, device.type())),
      message_bound_(device.is_cpu() ? vote_bound_ : WaitBound{}),
      fingerprint_(std::move(fingerprint)),
      fingerprint_slots_(fingerprint_.vote_slots()) {}

P2PChannel::~P2PChannel() = default;

PendingSend P2PChannel::send(const Tensors& tensors, int dst, MessageTag tag) {
  std::vector<at::Tensor> buffers{p2p::scatter_slice(pack_message(tensors), tp_rank_, tp_size_)};
  auto work = group_->send(buffers, dst, tag_of(tag));
  return {work, buffers[0], dst, tag};
}

PendingSend P2PChannel::send_header(const MessageMeta& meta, int dst, MessageTag tag) {
  std::vector<at::Tensor> buffers{meta.encode(device_)};
  auto work = group_->send(buffers, dst, tag_of(tag));
  return {work, buffers[0], dst, tag};
}

PendingRecv P2PChannel::post(const MessageMeta& meta, int src, MessageTag tag) {
  std::vector<at::Tensor> buffers{at::empty({p2p::sent_numel(wire_numel(meta), tp_size_)},
                                            at::TensorOptions().dtype(wire_dtype(meta)).device(device_))};
  auto work = group_->recv(buffers, src, tag_of(tag));
  return {work, buffers[0], src, tag};
}

PendingRecv P2PChannel::post_header(int src, MessageTag tag) {
  std::vector<at::Tensor> buffers{at::empty({kHeaderSlots}, at::TensorOptions().dtype(at::kLong).device(device_))};
  auto work = group_->recv(buffers, src, tag_of(tag));
  return {work, buffers[0], src, tag};
}

Tensors P2PChannel::finish(PendingRecv& recv, const MessageMeta& meta) {
  wait_bounded(*recv.work, message_bound_, [&] { return recv.tag.str() + " from rank " + std::to_string(recv.peer); });
  recv.work.reset();
  const bool lone = meta.tensors.size() == 1;  // a lone tensor travelled as itself
  const std::vector<int64_t> shape = lone ? meta.tensors[0].shape : std::vector<int64_t>{wire_numel(meta)};
  at::Tensor whole;
  bounded(
      message_bound_,
      [&] { return "the all-gather of the slices of " + recv.tag.str() + " over TP group '" + tp_group_name_ + "'"; },
      [&] { whole = p2p::gather_slices(recv.buffer, shape, tp_group_name_, tp_size_, message_bound_.timeout); });
  return lone ? Tensors{whole} : unpack_message(whole, meta);
}

MessageMeta P2PChannel::finish_header(PendingRecv& recv) {
  wait_bounded(*recv.work, message_bound_, [&] { return recv.tag.str() + " from rank " + std::to_string(recv.peer); });
  recv.work.reset();
  return MessageMeta::decode(recv.buffer);
}

void P2PChannel::finish_send(PendingSend& send) {
  wait_bounded(*send.work, message_bound_,
               [&] { return "rank " + std::to_string(send.peer) + " to receive " + send.tag.str(); });
}

PendingRecv P2PChannel::post_vote(bool exchange_meta, int step_kind) {
  // One MAX all-reduce answers all: any rank's flag, the kinds' max and (negated) min, and the
  // same for each fingerprint field's hash.
  std::vector<int64_t> slots{exchange_meta ? 1 : 0, step_kind, -step_kind};
  slots.insert(slots.end(), fingerprint_slots_.begin(), fingerprint_slots_.end());
  auto host = at::tensor(slots, at::TensorOptions().dtype(at::kLong));
  // Pinned, so the copy to a device is queued on its stream instead of waiting for the host.
  if (!device_.is_cpu()) host = host.pin_memory();
  std::vector<at::Tensor> tensors{host.to(device_, /*non_blocking=*/true)};
  c10d::AllreduceOptions options;
  options.reduceOp = c10d::ReduceOp::MAX;
  auto work = group_->allreduce(tensors, options);
  return {work, tensors[0]};
}

P2PChannel::Vote P2PChannel::read_vote(PendingRecv& vote) {
  wait_bounded(*vote.work, vote_bound_, [] {
    return std::string("the step-start vote of every rank of the pipeline group (a rank that has not started "
                       "the step, or is stopped)");
  });
  vote.work.reset();
  const at::Tensor values = vote.buffer.cpu();
  const int64_t* v = values.data_ptr<int64_t>();
  return {v[0] > 0, v[1] == -v[2], disagreeing_fields(v + 3)};
}

std::string P2PChannel::disagreement_message(const std::vector<size_t>& fields) {
  return runtime::disagreement_message(*group_, fingerprint_, fields, device_, vote_bound_);
}

}  // namespace torchpp::runtime
