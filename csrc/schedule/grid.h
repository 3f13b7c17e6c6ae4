// ASCII rank x step grid of a schedule, used by error messages and the CLI.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "schedule/ir.h"

namespace torchpp::schedule {

// One row per rank, one column per step (position in the rank's action list). Cells listed
// in `marks` as (rank, step) are drawn as >cell< and the grid is cut to a window around the
// first mark so that errors on large schedules stay readable; `max_steps` <= 0 shows all.
std::string format_grid(const Schedule& schedule,
                        const std::vector<std::pair<int, int>>& marks = {},
                        int max_steps = 0);

}  // namespace torchpp::schedule
