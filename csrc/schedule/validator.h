// Validator: the invariants a runtime relies on, checked before anything executes.
#pragma once

#include "schedule/ir.h"

namespace torchpp::schedule {

// Throws ScheduleError, with the rank x step grid and the offending step marked, unless:
//  - placement is consistent: every action of stage s is on stage_to_rank[s];
//  - every (stage, microbatch of its pipeline) has one F and either one B or one I and one W;
//  - on its rank every F precedes its I/B and every I precedes its W;
//  - lowered schedules: each cross-rank boundary has one SEND after its producer and one RECV
//    before its consumer, and on every ordered rank pair sends and receives match in order;
//  - the schedule runs to completion without deadlock.
void validate(const Schedule& schedule);

}  // namespace torchpp::schedule
