// Which pass a thread runs, and the twin groups the backward pass talks on.
//
// The pipeline executor's forward-backward overlap (DualPipe's) runs one microbatch's forward
// and another's backward at once, in two threads. Ranks match the collectives of a group by
// their order, and two threads sharing one group would interleave theirs differently on each
// rank; so a group used by both passes gets a twin (the same ranks, another communicator) and
// every collective issued while a thread runs a backward pass goes to the twin. Ops resolve
// their group through resolve_group (process_group.h), which applies this, so they need no
// knowledge of it. (The pass is per thread: on accelerators, whose autograd engine runs
// backward on its own threads, the overlap is not offered.)
#pragma once

#include <string>

namespace torchpp {

enum class Pass : char { Forward, Backward };

// Sets the calling thread's pass for its lifetime, restoring the previous one.
class PassGuard {
 public:
  explicit PassGuard(Pass pass);
  ~PassGuard();
  PassGuard(const PassGuard&) = delete;
  PassGuard& operator=(const PassGuard&) = delete;

 private:
  Pass previous_;
};

Pass current_pass();

// Registers `twin_name` as the group the backward pass of `group_name` uses ("" removes it).
void set_backward_group(const std::string& group_name, const std::string& twin_name);

// The name of the group to talk on for `group_name` in the calling thread's pass.
std::string group_for_current_pass(const std::string& group_name);

}  // namespace torchpp
