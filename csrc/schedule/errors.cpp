#include "schedule/errors.h"

namespace torchpp::schedule {

void constraint_error(const std::string& schedule, const std::string& constraint,
                      const std::string& values) {
  throw std::invalid_argument(schedule + ": requires " + constraint + " (got " + values + ")");
}

}  // namespace torchpp::schedule
