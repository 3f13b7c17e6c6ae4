// Lowering and checking for transports that match messages by order, not by tag, and whose
// sends may wait until the peer has posted the receive (NCCL): the order of a rank's SEND/RECV
// actions is then the order in which they occupy its communication stream.
#pragma once

#include "schedule/ir.h"

namespace torchpp::schedule {

// Like lower(), but every message takes one place in a global order (its producer's end in a
// unit-cost simulation) and both of its ranks issue it there: the SEND right after the
// producer, the RECV before any compute that starts at or after that time. Both ranks of a
// pair therefore issue their shared messages in the same order, and check_in_order_p2p holds.
Schedule lower_in_order(const Schedule& schedule);

// Throws ScheduleError unless a lowered schedule completes under a blocking model: each rank
// issues its actions in order; compute runs on one stream and SEND/RECV on one communication
// stream, each in issue order; a message starts when the compute issued before it has run,
// completes only while both its SEND and its RECV are at the front of their streams, and a
// compute waits for the receives it consumes. One communication stream per rank is the
// strictest placement: any deadlock-free order here is also one with a stream per peer.
void check_in_order_p2p(const Schedule& lowered);

}  // namespace torchpp::schedule
