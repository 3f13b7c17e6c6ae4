// Bounded blocking waits: no rank of a pipeline waits on a peer for longer than the pipeline's
// timeout (build_schedule(timeout=), TORCHPP_PIPELINE_TIMEOUT, default 10 minutes, never more
// than the process group's own timeout). A wait that runs out raises WaitTimeout, which names
// what was waited for and from which rank; the executor fails the step on every rank with it.
#pragma once

#include <chrono>
#include <functional>
#include <string>

#include <c10/core/DeviceType.h>

#include "runtime/failure.h"

namespace c10d {
class ProcessGroup;
class Work;
}  // namespace c10d

namespace torchpp::runtime {

// How long one wait may last; zero: unbounded here (the backend's own timeout applies).
struct WaitBound {
  std::chrono::milliseconds timeout{0};
  std::string source;  // where the bound comes from, for the message
};

// The bound for waits on `group`: `timeout` (zero: none), or the group's own timeout for
// `device_type` when that is shorter.
WaitBound wait_bound(std::chrono::milliseconds timeout, c10d::ProcessGroup& group, c10::DeviceType device_type);

// A wait that outlasted its bound; Python sees PipelineTimeoutError.
class WaitTimeout : public PipelineFailure {
 public:
  explicit WaitTimeout(const std::string& message) : PipelineFailure(FailureKind::Timeout, message) {}
};

// Runs `blocking`, which itself gives up at `bound.timeout`; an error it raises once the bound
// has passed is the bound's: WaitTimeout saying how long this rank waited for `what()`
// (e.g. "the activation for stage 1 microbatch 2 from rank 0"). Earlier errors (a peer broke
// the connection, or died) propagate as std::runtime_error saying what was waited for.
void bounded(const WaitBound& bound, const std::function<std::string()>& what, const std::function<void()>& blocking);

// Waits for `work` within `bound`.
void wait_bounded(c10d::Work& work, const WaitBound& bound, const std::function<std::string()>& what);

}  // namespace torchpp::runtime
