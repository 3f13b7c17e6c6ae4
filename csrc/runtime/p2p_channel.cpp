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

int MessageTag::value() const {
  TORCH_CHECK(microbatch < kMaxMicrobatches, "torchpp pipeline: at most ", kMaxMicrobatches, " microbatches");
  return (((consumer_stage * 2 + static_cast<int>(direction)) * 2 + (header ? 1 : 0)) * kMaxMicrobatches) + microbatch;
}

P2PChannel::P2PChannel(const std::string& group_name, std::string tp_group_name, int64_t tp_rank, int64_t tp_size,
                       bool scatter_gather, bool in_order, c10::Device device)
    : group_(resolve_group(group_name)),
      in_order_(in_order),
      tp_group_name_(std::move(tp_group_name)),
      tp_rank_(scatter_gather ? tp_rank : 0),
      tp_size_(scatter_gather ? tp_size : 1),
      device_(device) {}

P2PChannel::~P2PChannel() = default;

PendingSend P2PChannel::send(const Tensors& tensors, int dst, MessageTag tag) {
  std::vector<at::Tensor> buffers{p2p::scatter_slice(pack_message(tensors), tp_rank_, tp_size_)};
  auto work = group_->send(buffers, dst, tag_of(tag));
  return {work, buffers[0]};
}

PendingSend P2PChannel::send_header(const MessageMeta& meta, int dst, MessageTag tag) {
  std::vector<at::Tensor> buffers{meta.encode(device_)};
  auto work = group_->send(buffers, dst, tag_of(tag));
  return {work, buffers[0]};
}

PendingRecv P2PChannel::post(const MessageMeta& meta, int src, MessageTag tag) {
  std::vector<at::Tensor> buffers{at::empty({p2p::sent_numel(wire_numel(meta), tp_size_)},
                                            at::TensorOptions().dtype(wire_dtype(meta)).device(device_))};
  auto work = group_->recv(buffers, src, tag_of(tag));
  return {work, buffers[0]};
}

PendingRecv P2PChannel::post_header(int src, MessageTag tag) {
  std::vector<at::Tensor> buffers{at::empty({kHeaderSlots}, at::TensorOptions().dtype(at::kLong).device(device_))};
  auto work = group_->recv(buffers, src, tag_of(tag));
  return {work, buffers[0]};
}

Tensors P2PChannel::finish(PendingRecv& recv, const MessageMeta& meta) {
  recv.work->wait();
  recv.work.reset();
  if (meta.tensors.size() == 1) {  // a lone tensor travelled as itself
    return {p2p::gather_slices(recv.buffer, meta.tensors[0].shape, tp_group_name_, tp_size_)};
  }
  return unpack_message(p2p::gather_slices(recv.buffer, {wire_numel(meta)}, tp_group_name_, tp_size_), meta);
}

MessageMeta P2PChannel::finish_header(PendingRecv& recv) {
  recv.work->wait();
  recv.work.reset();
  return MessageMeta::decode(recv.buffer);
}

PendingRecv P2PChannel::post_vote(bool exchange_meta, int step_kind) {
  // One MAX all-reduce answers both: any rank's flag, and the kinds' max and (negated) min.
  std::vector<at::Tensor> tensors{
      at::tensor({exchange_meta ? 1 : 0, step_kind, -step_kind}, at::TensorOptions().dtype(at::kLong)).to(device_)};
  c10d::AllreduceOptions options;
  options.reduceOp = c10d::ReduceOp::MAX;
  auto work = group_->allreduce(tensors, options);
  return {work, tensors[0]};
}

P2PChannel::Vote P2PChannel::read_vote(PendingRecv& vote) {
  vote.work->wait();
  vote.work.reset();
  const at::Tensor values = vote.buffer.cpu();
  const int64_t* v = values.data_ptr<int64_t>();
  return {v[0] > 0, v[1] == -v[2]};
}

}  // namespace torchpp::runtime
