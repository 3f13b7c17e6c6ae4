// Error types of the schedule compiler; the Python module maps both to ValueError subclasses.
#pragma once

#include <stdexcept>
#include <string>

namespace torchpp::schedule {

// A schedule that breaks an invariant (order, counts, placement, FIFO, deadlock). The message
// carries the rank x step grid with the offending step marked.
class ScheduleError : public std::runtime_error {
 public:
  explicit ScheduleError(const std::string& what) : std::runtime_error(what) {}
};

// Generators report an unsupported (p, m, v) with std::invalid_argument naming the constraint.
[[noreturn]] void constraint_error(const std::string& schedule, const std::string& constraint,
                                   const std::string& values);

}  // namespace torchpp::schedule
