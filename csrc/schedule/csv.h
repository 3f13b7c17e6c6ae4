// CSV exchange in torch.distributed.pipelining's format (_dump_csv/_load_csv): one row per
// rank, one action string per cell; empty cells (torch's idle steps) are skipped.
#pragma once

#include <string>

#include "schedule/ir.h"

namespace torchpp::schedule {

std::string to_csv(const Schedule& schedule);

// Stages, their placement and whether the schedule is lowered are read off the actions.
// num_pipelines = 0 infers it: 2 (DualPipe) when the first stage only sees the first half of
// the microbatches, else 1. Throws std::invalid_argument on malformed text; validate() the result.
Schedule from_csv(const std::string& text, int num_ranks, int num_microbatches, int num_pipelines = 0);

}  // namespace torchpp::schedule
