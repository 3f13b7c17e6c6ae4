// Failing a pipeline step on every rank instead of hanging: the rank that fails first writes its
// error into the pipeline group's store and aborts its process groups, which breaks its peers'
// pending receives at once; each peer then raises the same error (the first rank's message)
// and aborts its own groups in turn, so the failure reaches every rank. A configuration mismatch
// (the step-start fingerprint) is seen by every rank at once, before any message, and leaves the
// groups usable.
#pragma once

#include <stdexcept>
#include <string>
#include <vector>

namespace torchpp::runtime {

// Generic: PipelineError; Shape: PipelineShapeError; Config: PipelineConfigError (ranks built
// different schedules); Timeout: PipelineTimeoutError (a bounded wait ran out).
enum class FailureKind : char { Generic = 'G', Shape = 'S', Config = 'C', Timeout = 'T' };

// What the executor raises; the bindings map each kind to its Python exception.
class PipelineFailure : public std::runtime_error {
 public:
  PipelineFailure(FailureKind kind, const std::string& message) : std::runtime_error(message), kind_(kind) {}
  FailureKind kind() const { return kind_; }

 private:
  FailureKind kind_;
};

class FailurePropagation {
 public:
  // `store_group` holds the store the message goes through; `abort_groups` are broken so
  // that no peer keeps waiting on this rank.
  FailurePropagation(std::string store_group, std::vector<std::string> abort_groups);

  // Turns `error`, raised on `rank` while running `where`, into the step's PipelineFailure:
  // the first failure of the group (root cause) or this rank's view of a peer's failure.
  [[noreturn]] void fail(const std::exception& error, int rank, const std::string& where) const;

  // Raises the recorded failure if a peer failed (checked at the end of each step).
  void raise_if_peer_failed(int rank) const;

 private:
  std::string store_group_;
  std::vector<std::string> abort_groups_;
};

}  // namespace torchpp::runtime
