// The executor's forward-backward overlap (executor.h): which neighbouring F and B/I run at
// once, and running them.
#include <thread>

#include <ATen/ThreadLocalState.h>

#include "runtime/executor.h"

namespace torchpp::runtime {

using schedule::Action;
using schedule::ActionType;

namespace {

bool is_backward(ActionType type) {
  return type == ActionType::B || type == ActionType::I;
}

bool is_recv(ActionType type) {
  return type == ActionType::RECV_F || type == ActionType::RECV_B;
}

// A SEND of `action`'s own result.
bool sends_result_of(const Action& send, const Action& action) {
  const ActionType kind = action.type == ActionType::F ? ActionType::SEND_F : ActionType::SEND_B;
  return send.type == kind && send.stage == action.stage && send.microbatch == action.microbatch;
}

}  // namespace

std::vector<int> Executor::overlap_partners() const {
  std::vector<int> partner(actions_.size(), -1);
  const bool trains = std::any_of(actions_.begin(), actions_.end(), [](const Action& a) { return is_backward(a.type); });
  if (!config_.overlap_forward_backward || !trains) return partner;
  for (size_t i = 0; i < actions_.size(); ++i) {
    const Action& first = actions_[i];
    if (first.type != ActionType::F && !is_backward(first.type)) continue;
    size_t j = i + 1;
    bool sent = false, ok = true;
    for (; j < actions_.size() && !schedule::is_compute(actions_[j].type); ++j) {
      const Action& between = actions_[j];
      if (sends_result_of(between, first)) {
        sent = true;
      } else if (is_recv(between.type)) {
        // Issued while the first runs: it must not be the first's own gradient (sized by its
        // forward), nor follow one of its sends in an in-order schedule (the order would change).
        const bool own = between.stage == first.stage && between.microbatch == first.microbatch;
        ok = ok && !own && !(sent && config_.in_order);
      } else {
        ok = false;
      }
    }
    if (!ok || j == actions_.size()) continue;
    const Action& second = actions_[j];
    // One forward and one backward, of different microbatches: their graphs share nothing.
    const bool mixed = (first.type == ActionType::F) != (second.type == ActionType::F) &&
                       (second.type == ActionType::F || is_backward(second.type));
    if (!mixed || first.microbatch == second.microbatch) continue;
    partner[i] = static_cast<int>(j);
    i = j;  // a pair does not chain into the next
  }
  return partner;
}

void Executor::run_overlapped(size_t first, size_t second) {
  const Action& a = actions_[first];
  const Action& x = actions_[second];
  current_record_ = timeline_.start(a.str(), /*compute=*/true);
  Work first_work = prepare(a);
  double first_end = 0.0;
  std::exception_ptr first_error;
  const at::ThreadLocalState caller_state;  // grad mode, autocast, saved-tensor hooks, profiler
  std::thread worker([&] {
    at::ThreadLocalStateGuard state(caller_state);
    try {
      compute(first_work);
    } catch (const std::exception& error) {
      first_error = share_failure(error, "action " + a.str());
    } catch (...) {
      first_error = share_failure(std::runtime_error("unknown error"), "action " + a.str());
    }
    first_end = now_us();
  });
  std::exception_ptr second_error;
  Work second_work;
  try {
    for (size_t k = first + 1; k < second; ++k) {
      if (!is_recv(actions_[k].type)) continue;
      const size_t record = timeline_.start(actions_[k].str(), /*compute=*/false);
      run(actions_[k]);
      timeline_.end(record);
    }
    current_record_ = timeline_.start(x.str(), /*compute=*/true);
    second_work = prepare(x);
    compute(second_work);
    timeline_.end(second_work.record);
  } catch (const std::exception& error) {
    second_error = share_failure(error, "action " + x.str());
  }
  worker.join();  // a failed side broke the groups, so the other returns
  timeline_.end_at(first_work.record, first_end);
  if (first_error || second_error) {
    shared_failure_ = first_error ? first_error : second_error;
    std::rethrow_exception(shared_failure_);
  }
  finish(first_work);
  finish(second_work);
  for (size_t k = first + 1; k < second; ++k) {
    if (is_recv(actions_[k].type)) continue;
    const size_t record = timeline_.start(actions_[k].str(), /*compute=*/false);
    run(actions_[k]);
    timeline_.end(record);
  }
}

std::exception_ptr Executor::share_failure(const std::exception& error, const std::string& where) noexcept {
  try {
    failure_.fail(error, config_.rank, where);
  } catch (...) {
    return std::current_exception();
  }
  return std::make_exception_ptr(PipelineFailure(FailureKind::Generic, error.what()));  // unreachable: fail throws
}

}  // namespace torchpp::runtime
