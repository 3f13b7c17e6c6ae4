#include "ops/process_group.h"

#include "ops/c10d_compat.h"
#include "ops/pass_groups.h"

#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

namespace torchpp {

c10::intrusive_ptr<c10d::ProcessGroup> resolve_group(const std::string& group_name) {
  try {
    return c10d::resolve_process_group(group_for_current_pass(group_name));
  } catch (const std::exception&) {
    TORCH_CHECK(
        false,
        "torchpp: unknown process group name '", group_name,
        "': pass a ProcessGroup, or the group_name of a group created with "
        "torch.distributed.init_process_group/new_group in this process");
  }
}

void check_group_size(
    const c10d::ProcessGroup& group,
    const std::string& group_name,
    int64_t expected_size,
    const char* op_name) {
  TORCH_CHECK(
      group.getSize() == expected_size,
      "torchpp.", op_name, ": group '", group_name, "' has ", group.getSize(),
      " ranks but group_size=", expected_size, " was passed");
}

void check_device_supported(
    c10d::ProcessGroup& group,
    const std::string& group_name,
    const at::Tensor& tensor,
    const char* op_name) {
  const auto device_type = tensor.device().type();
  TORCH_CHECK(
      c10d_compat::has_backend_for(group, device_type),
      "torchpp.", op_name, ": tensor is on device '", tensor.device(),
      "' but process group '", group_name, "' (backend ", group.getBackendName(),
      ") has no backend for that device type; move the tensor to the group's device");
}

} // namespace torchpp
