// Non-blocking sends and receives of pipeline messages over the pipeline process group.
// Tagged (gloo): every message has its own tag (direction, consuming stage, microbatch, header
// or data), so a receive can be posted whenever its size is known and never match the wrong
// message. In order (NCCL, which ignores tags): one tag for data and one for headers, so gloo
// too matches by order, and the schedule's in-order lowering keeps both ranks' orders equal.
// A message of several tensors travels packed in one buffer (message_buffer.h). With
// scatter/gather on, each TP rank moves only its 1/t slice and the receivers all-gather.
// Streams are c10d's: ProcessGroupNCCL runs each send/recv on its own stream after an event
// on the caller's current stream, and Work::wait() makes the current stream wait for it
// without blocking the host, so compute and P2P overlap with no stream code here.
#pragma once

#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>

#include "runtime/tensor_meta.h"

namespace c10d {
class ProcessGroup;
class Work;
}  // namespace c10d

namespace torchpp::runtime {

enum class Direction : int { Forward = 0, Backward = 1 };

struct MessageTag {
  Direction direction;
  int consumer_stage;
  int microbatch;
  bool header;
  int value() const;
};

// A posted receive; `buffer` is valid once `work` has been waited on.
struct PendingRecv {
  c10::intrusive_ptr<c10d::Work> work;
  at::Tensor buffer;
};

struct PendingSend {
  c10::intrusive_ptr<c10d::Work> work;
  at::Tensor buffer;  // kept alive until the send completes
};

class P2PChannel {
 public:
  P2PChannel(const std::string& group_name, std::string tp_group_name, int64_t tp_rank, int64_t tp_size,
             bool scatter_gather, bool in_order, c10::Device device);
  ~P2PChannel();

  PendingSend send(const Tensors& tensors, int dst, MessageTag tag);
  PendingSend send_header(const MessageMeta& meta, int dst, MessageTag tag);
  // Posts the receive of a message of `meta` (this rank's slice of it under scatter/gather).
  PendingRecv post(const MessageMeta& meta, int src, MessageTag tag);
  PendingRecv post_header(int src, MessageTag tag);
  // Waits for a posted message and returns the whole tensors of `meta`.
  Tensors finish(PendingRecv& recv, const MessageMeta& meta);
  MessageMeta finish_header(PendingRecv& recv);

  // The step-start agreement over the pipeline group: whether any rank needs headers this
  // step, and whether all ranks run the same kind of step (train or eval). An all-reduce that
  // runs in the background until read_vote, so no rank waits for it before it needs the answer.
  PendingRecv post_vote(bool exchange_meta, int step_kind);  // arrives like a receive
  struct Vote {
    bool exchange_meta;  // some rank asked for headers
    bool same_kind;      // every rank runs the same kind of step
  };
  Vote read_vote(PendingRecv& vote);
  c10d::ProcessGroup& group() { return *group_; }

 private:
  int tag_of(const MessageTag& tag) const { return in_order_ ? (tag.header ? 1 : 0) : tag.value(); }

  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  bool in_order_;
  std::string tp_group_name_;
  int64_t tp_rank_;
  int64_t tp_size_;  // 1 when scatter/gather is off
  c10::Device device_;
};

}  // namespace torchpp::runtime
