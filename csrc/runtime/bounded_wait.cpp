#include "runtime/bounded_wait.h"

#include <cstdio>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

namespace torchpp::runtime {
namespace {

// A wait that ends this close to its bound ended because of it (timers wake a little late or early).
constexpr auto kSlack = std::chrono::milliseconds(5);

std::string seconds(std::chrono::steady_clock::duration duration) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.1f s", std::chrono::duration<double>(duration).count());
  return text;
}

}  // namespace

WaitBound wait_bound(std::chrono::milliseconds timeout, c10d::ProcessGroup& group, c10::DeviceType device_type) {
  std::chrono::milliseconds own{0};
  try {
    // Test backends (torch's "fake") have neither options nor a store: no timeout of their own.
    auto backend = group.getBackend(device_type);
    auto options = backend ? backend->getBackendOptions() : nullptr;
    if (options) own = options->timeout;
  } catch (const std::exception&) {
    // A backend that does not report its options: the pipeline's timeout alone.
  }
  if (timeout.count() > 0 && (own.count() <= 0 || timeout <= own)) {
    return {timeout, "the pipeline timeout (build_schedule(timeout=...) or TORCHPP_PIPELINE_TIMEOUT)"};
  }
  if (own.count() > 0) return {own, "the process group's timeout, shorter than the pipeline timeout"};
  return {};
}

void bounded(const WaitBound& bound, const std::function<std::string()>& what, const std::function<void()>& blocking) {
  if (bound.timeout.count() <= 0) {
    try {
      blocking();
    } catch (const std::exception& error) {
      throw std::runtime_error("while waiting for " + what() + ": " + error.what());
    }
    return;
  }
  const auto start = std::chrono::steady_clock::now();
  try {
    blocking();
  } catch (const std::exception& error) {
    const auto waited = std::chrono::steady_clock::now() - start;
    if (waited + kSlack < bound.timeout) {
      // Not a PipelineFailure, so the failure path still looks for a peer's own message.
      throw std::runtime_error("while waiting for " + what() + ": " + error.what());
    }
    throw WaitTimeout("waited " + seconds(waited) + " for " + what() + ", the limit set by " + bound.source + " (" +
                      seconds(bound.timeout) + "): the peer is stopped, hung, or slower than the limit allows");
  }
}

void wait_bounded(c10d::Work& work, const WaitBound& bound, const std::function<std::string()>& what) {
  bounded(bound, what, [&] {
    if (bound.timeout.count() <= 0) {
      work.wait();
    } else if (!work.wait(bound.timeout)) {
      throw std::runtime_error("not completed");
    }
  });
}

}  // namespace torchpp::runtime
