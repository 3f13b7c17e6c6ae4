#include "runtime/failure.h"

#include <chrono>
#include <thread>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "ops/process_group.h"

namespace torchpp::runtime {
namespace {

const std::string kFailureKey = "torchpp_pipeline_failure";
// How long a rank whose communication broke waits for its peer's message to appear.
constexpr auto kPeerMessageWait = std::chrono::milliseconds(1500);
// A tag no pipeline message uses.
constexpr int kBreakTag = 0x7ffffff0;

bool read_failure(c10d::Store& store, FailureKind* kind, std::string* message) {
  if (!store.check({kFailureKey})) {
    return false;
  }
  auto bytes = store.get(kFailureKey);
  std::string value(bytes.begin(), bytes.end());
  *kind = value.empty() ? FailureKind::Generic : static_cast<FailureKind>(value[0]);
  *message = value.empty() ? std::string() : value.substr(1);
  return true;
}

// Unblocks every peer waiting on this rank. gloo's abort() leaves pending receives (its own and
// its peers') waiting, but a receive that times out closes all of the group's connections on
// this rank, which fails each peer's pending operation with this rank at once; so time one out.
void break_group(c10d::ProcessGroup& group) {
  if (group.getSize() > 1 && group.getBackendName() == "gloo") {
    const int peer = (group.getRank() + 1) % group.getSize();
    std::vector<at::Tensor> scratch{at::empty({1})};
    try {
      group.recv(scratch, peer, kBreakTag)->wait(std::chrono::milliseconds(1));
    } catch (const std::exception&) {
      // Expected: the timeout is what closes the connections.
    }
  }
  group.abort();  // NCCL and other backends abort their communicators
}

// The store failures are shared through; null for groups made without one (torch's "fake" backend).
c10::intrusive_ptr<c10d::Store> group_store(const std::string& name) {
  return resolve_group(name)->getStore();
}

}  // namespace

FailurePropagation::FailurePropagation(std::string store_group, std::vector<std::string> abort_groups)
    : store_group_(std::move(store_group)), abort_groups_(std::move(abort_groups)) {}

void FailurePropagation::fail(const std::exception& error, int rank, const std::string& where) const {
  FailureKind kind = FailureKind::Generic;
  if (auto* failure = dynamic_cast<const PipelineFailure*>(&error)) {
    kind = failure->kind();
  }
  if (kind == FailureKind::Config) {
    // Every rank found it at the same vote, before any message: nothing waits, nothing to break.
    throw PipelineFailure(kind, error.what());
  }
  std::string message;
  bool peer_failed = false;
  try {
    auto store = group_store(store_group_);
    if (!store) throw std::runtime_error("the process group has no store");
    // A broken connection usually means a peer failed; give its message time to arrive.
    const auto deadline = std::chrono::steady_clock::now() + kPeerMessageWait;
    FailureKind peer_kind = FailureKind::Generic;
    std::string peer_message;
    while (!(peer_failed = read_failure(*store, &peer_kind, &peer_message)) &&
           std::chrono::steady_clock::now() < deadline && dynamic_cast<const PipelineFailure*>(&error) == nullptr) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    if (peer_failed) {
      kind = peer_kind;
      message = "torchpp pipeline: rank " + std::to_string(rank) + " stopped at " + where +
                " because another rank failed: " + peer_message;
    } else {
      message = "torchpp pipeline: rank " + std::to_string(rank) + " failed at " + where + ": " + error.what();
      std::string value(1, static_cast<char>(kind));
      value += message;
      store->set(kFailureKey, std::vector<uint8_t>(value.begin(), value.end()));
    }
  } catch (const std::exception& store_error) {
    message = "torchpp pipeline: rank " + std::to_string(rank) + " failed at " + where + ": " + error.what() +
              " (the failure could not be shared with the other ranks: " + store_error.what() + ")";
  }
  for (const auto& name : abort_groups_) {
    try {
      break_group(*resolve_group(name));
    } catch (const std::exception&) {
      // Already gone: nothing left to unblock.
    }
  }
  throw PipelineFailure(kind, message);
}

void FailurePropagation::raise_if_peer_failed(int rank) const {
  auto store = group_store(store_group_);
  if (!store) return;  // no store, no peer that could have written to one
  FailureKind kind;
  std::string message;
  bool failed = false;
  try {
    failed = read_failure(*store, &kind, &message);
  } catch (const std::exception&) {
    return;  // a store that cannot be read (a test store): no peer could have shared a failure through it
  }
  if (failed) {
    throw PipelineFailure(kind, "torchpp pipeline: rank " + std::to_string(rank) +
                                    " finished its step but another rank failed: " + message);
  }
}

}  // namespace torchpp::runtime
