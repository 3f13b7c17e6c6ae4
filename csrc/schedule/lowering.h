// Lowering: inserts SEND/RECV actions at every stage boundary that crosses ranks.
#pragma once

#include "schedule/ir.h"

namespace torchpp::schedule {

// SEND_F/SEND_B right after the producing compute action; on the receiver, RECVs are posted
// in the sender's order (FIFO per ordered rank pair), each no later than just before its
// consumer (see ir.h for the non-blocking semantics). Throws ScheduleError when a consumer's
// producer is missing.
Schedule lower(const Schedule& schedule);

// The compute actions of a (possibly lowered) schedule.
Schedule compute_only(const Schedule& schedule);

// The forward passes alone, each rank's in the schedule's order (an evaluation step: the F
// order of a valid schedule never waits on a backward, so it stays valid without them).
Schedule forward_only(const Schedule& schedule);

}  // namespace torchpp::schedule
