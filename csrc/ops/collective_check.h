// Before each collective over gloo, the ranks check that they pass the same kind of collective
// a tensor of one shape and dtype: gloo aborts the whole process (SIGABRT from its I/O thread)
// when a peer's message is larger than the buffer it posted, so a mismatch must be found before
// the data travels. The check is one all-reduce of two int64 (its cost per op is measured in
// docs/benchmarks.md); on a mismatch every rank raises, naming each rank's shape. Backends that
// do not abort on it (NCCL) are not checked: reading the answer would make the host wait for
// the device. TORCHPP_COLLECTIVE_CHECKS=0, or set_collective_checks(false), turns it off.
#pragma once

#include <string>

#include <ATen/core/Tensor.h>

namespace c10d {
class ProcessGroup;
}

namespace torchpp {

enum class CollectiveKind : int64_t { AllReduce = 1, AllGather = 2, ReduceScatter = 3, AllToAll = 4 };

void check_same_input(c10d::ProcessGroup& group, const std::string& group_name, const at::Tensor& input,
                      CollectiveKind kind, const char* op_name);

bool collective_checks();
void set_collective_checks(bool enabled);

}  // namespace torchpp
