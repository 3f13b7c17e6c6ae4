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
// Every wait that blocks the host is bounded (bounded_wait.h): on the CPU each receive, send
// and all-gather; on devices the step-start vote (read on the host), while a device-side wait
// is bounded by the backend's own watchdog (NCCL: the process group's timeout).
#pragma once

#include <chrono>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>

#include "runtime/bounded_wait.h"
#include "runtime/fingerprint.h"
#include "runtime/tensor_meta.h"

namespace c10d {
class ProcessGroup;
class Work;
}  // namespace c10d

namespace torchpp::runtime {

enum class Direction : int { Forward = 0, Backward = 1 };

struct MessageTag {
  Direction direction = Direction::Forward;
  int consumer_stage = 0;
  int microbatch = 0;
  bool header = false;
  int value() const;
  // "the activation for stage 1 microbatch 2", "the shape header of ...", "the gradient for ..."
  std::string str() const;
};

// A posted receive; `buffer` is valid once `work` has been waited on.
struct PendingRecv {
  c10::intrusive_ptr<c10d::Work> work;
  at::Tensor buffer;
  int peer = -1;  // the sender (-1: a collective)
  MessageTag tag;
};

struct PendingSend {
  c10::intrusive_ptr<c10d::Work> work;
  at::Tensor buffer;  // kept alive until the send completes
  int peer = -1;
  MessageTag tag;
};

class P2PChannel {
 public:
  // `timeout`: the longest any wait may last (zero: the backend's own timeout); `fingerprint`:
  // what the step-start vote checks every rank agrees on.
  P2PChannel(const std::string& group_name, std::string tp_group_name, int64_t tp_rank, int64_t tp_size,
             bool scatter_gather, bool in_order, c10::Device device, std::chrono::milliseconds timeout,
             Fingerprint fingerprint);
  ~P2PChannel();

  PendingSend send(const Tensors& tensors, int dst, MessageTag tag);
  PendingSend send_header(const MessageMeta& meta, int dst, MessageTag tag);
  // Posts the receive of a message of `meta` (this rank's slice of it under scatter/gather).
  PendingRecv post(const MessageMeta& meta, int src, MessageTag tag);
  PendingRecv post_header(int src, MessageTag tag);
  // Waits for a posted message and returns the whole tensors of `meta`.
  Tensors finish(PendingRecv& recv, const MessageMeta& meta);
  MessageMeta finish_header(PendingRecv& recv);
  // Waits until a send has completed (its buffer may then be reused).
  void finish_send(PendingSend& send);

  // The step-start agreement over the pipeline group: whether any rank needs headers this
  // step, whether all ranks run the same kind of step (train or eval), and whether all built
  // the same schedule (the fingerprint). An all-reduce that runs in the background until
  // read_vote, so no rank waits for it before it needs the answer.
  PendingRecv post_vote(bool exchange_meta, int step_kind);  // arrives like a receive
  struct Vote {
    bool exchange_meta;                 // some rank asked for headers
    bool same_kind;                     // every rank runs the same kind of step
    std::vector<size_t> disagreements;  // fingerprint fields on which ranks differ
  };
  Vote read_vote(PendingRecv& vote);
  // Names the fingerprint's disagreements on each rank; every rank must call it (after a vote
  // that found them).
  std::string disagreement_message(const std::vector<size_t>& fields);
  c10d::ProcessGroup& group() { return *group_; }

 private:
  int tag_of(const MessageTag& tag) const { return in_order_ ? (tag.header ? 1 : 0) : tag.value(); }

  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  bool in_order_;
  std::string tp_group_name_;
  int64_t tp_rank_;
  int64_t tp_size_;  // 1 when scatter/gather is off
  c10::Device device_;
  WaitBound vote_bound_;     // the vote is read on the host on every device
  WaitBound message_bound_;  // messages block the host on the CPU only (devices: stream waits)
  Fingerprint fingerprint_;
  std::vector<int64_t> fingerprint_slots_;
};

}  // namespace torchpp::runtime
