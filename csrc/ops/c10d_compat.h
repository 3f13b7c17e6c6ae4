// c10d's ProcessGroup across the supported torch versions. torch 2.13 names the single-tensor
// collectives all_gather_single, reduce_scatter_single and all_to_all_single (the old
// _allgather_base, _reduce_scatter_base and alltoall_base are deprecated there), and has
// hasBackendForDeviceType; torch 2.11 and 2.12 have only the old names, and not that query.
#pragma once

#include <vector>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/version.h>

#define TORCHPP_C10D_SINGLE_NAMES (TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 13))

namespace torchpp::c10d_compat {

inline c10::intrusive_ptr<c10d::Work> all_gather_single(c10d::ProcessGroup& group, at::Tensor& output,
                                                        at::Tensor& input) {
#if TORCHPP_C10D_SINGLE_NAMES
  return group.all_gather_single(output, input);
#else
  return group._allgather_base(output, input);
#endif
}

inline c10::intrusive_ptr<c10d::Work> reduce_scatter_single(c10d::ProcessGroup& group, at::Tensor& output,
                                                            at::Tensor& input) {
#if TORCHPP_C10D_SINGLE_NAMES
  return group.reduce_scatter_single(output, input);
#else
  return group._reduce_scatter_base(output, input);
#endif
}

inline c10::intrusive_ptr<c10d::Work> all_to_all_single(c10d::ProcessGroup& group, at::Tensor& output,
                                                        at::Tensor& input, std::vector<int64_t>& output_splits,
                                                        std::vector<int64_t>& input_splits) {
#if TORCHPP_C10D_SINGLE_NAMES
  return group.all_to_all_single(output, input, output_splits, input_splits);
#else
  return group.alltoall_base(output, input, output_splits, input_splits);
#endif
}

// Whether the group has a backend for `device_type` (getDeviceTypes: in every supported version).
inline bool has_backend_for(const c10d::ProcessGroup& group, c10::DeviceType device_type) {
  for (const auto& device : group.getDeviceTypes()) {
    if (device.type() == device_type) {
      return true;
    }
  }
  return false;
}

}  // namespace torchpp::c10d_compat
