// Grid sweep: every generator over (p, m, v), validated, lowered and simulated, in one call so
// the whole grid runs in seconds from a test.
#pragma once

#include <string>
#include <vector>

#include "schedule/simulator.h"

namespace torchpp::schedule {

struct SweepResult {
  int served = 0;    // generated, validated (plain and lowered) and simulated
  int rejected = 0;  // refused with the documented constraint error
  std::vector<std::string> failures;  // anything else: "<name> p=.. m=.. v=..: <error>"
};

// p in 1..max_ranks, m in 1..max_microbatches, v in 1..max_chunks for each name.
SweepResult sweep(const std::vector<std::string>& names, int max_ranks, int max_microbatches,
                  int max_chunks, const Costs& costs = {});

}  // namespace torchpp::schedule
