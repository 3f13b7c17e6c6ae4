// Chrome Trace Event JSON of a simulated schedule (chrome://tracing, Perfetto).
#pragma once

#include <string>

#include "schedule/ir.h"
#include "schedule/simulator.h"

namespace torchpp::schedule {

// One process per rank with a compute track and a comm track; each transfer is a SEND slice
// on the sender and a RECV slice on the receiver joined by a flow arrow. One simulated time
// unit becomes `microseconds_per_unit` microseconds.
std::string chrome_trace_json(const Schedule& schedule, const Simulation& sim,
                              double microseconds_per_unit = 1000.0);

}  // namespace torchpp::schedule
