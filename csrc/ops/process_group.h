// Resolving a process group from the name torch.distributed gives it, with user-facing errors.
#pragma once

#include <string>

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>

namespace c10d {
class ProcessGroup;
}

namespace torchpp {

// Looks the group up in c10d's registry (its backward twin in a thread running a backward pass,
// pass_groups.h); an unknown name is a user error, not an internal one.
c10::intrusive_ptr<c10d::ProcessGroup> resolve_group(const std::string& group_name);

// The group's size must match the size the caller promised (fake kernels shape outputs with it).
void check_group_size(
    const c10d::ProcessGroup& group,
    const std::string& group_name,
    int64_t expected_size,
    const char* op_name);

// Collectives need a backend for the tensor's device; say which device and group when there is none.
void check_device_supported(
    c10d::ProcessGroup& group,
    const std::string& group_name,
    const at::Tensor& tensor,
    const char* op_name);

} // namespace torchpp
