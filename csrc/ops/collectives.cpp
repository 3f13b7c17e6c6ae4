#include "ops/collectives.h"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "ops/c10d_compat.h"
#include "ops/collective_check.h"
#include "ops/process_group.h"

namespace torchpp {
namespace {

c10::intrusive_ptr<c10d::ProcessGroup> group_for(
    const at::Tensor& input, const std::string& group_name, int64_t group_size, const char* op_name) {
  auto group = resolve_group(group_name);
  if (group_size > 0) {
    check_group_size(*group, group_name, group_size, op_name);
  }
  check_device_supported(*group, group_name, input, op_name);
  return group;
}

} // namespace

void check_group(const at::Tensor& input, const std::string& group_name, const char* op_name) {
  group_for(input, group_name, /*group_size=*/0, op_name);
}

int64_t shard_size(const at::Tensor& input, int64_t dim, int64_t group_size, const char* op_name) {
  TORCH_CHECK(group_size > 0, "torchpp.", op_name, ": group_size must be positive, got ", group_size);
  const int64_t wrapped = at::maybe_wrap_dim(dim, input.dim());
  const int64_t size = input.size(wrapped);
  TORCH_CHECK(
      size % group_size == 0,
      "torchpp.", op_name, ": dimension ", dim, " of size ", size,
      " is not divisible by the group size ", group_size, " (tensor shape ", input.sizes(), ")");
  return size / group_size;
}

at::Tensor all_reduce_sum(const at::Tensor& input, const std::string& group_name, const char* op_name) {
  auto group = group_for(input, group_name, /*group_size=*/0, op_name);
  check_same_input(*group, group_name, input, CollectiveKind::AllReduce, op_name);
  std::vector<at::Tensor> tensors{input.clone(at::MemoryFormat::Contiguous)};
  group->allreduce(tensors)->wait();
  return tensors[0];
}

at::Tensor all_gather_along(
    const at::Tensor& input, int64_t dim, const std::string& group_name, int64_t group_size, const char* op_name,
    std::chrono::milliseconds timeout) {
  auto group = group_for(input, group_name, group_size, op_name);
  check_same_input(*group, group_name, input, CollectiveKind::AllGather, op_name);
  const int64_t wrapped = at::maybe_wrap_dim(dim, input.dim());
  // Gather into a rank-major buffer, then move the rank axis back next to `dim`.
  auto leading = input.movedim(wrapped, 0).contiguous();
  auto sizes = leading.sizes().vec();
  sizes[0] *= group_size;
  auto gathered = at::empty(sizes, leading.options());
  auto work = c10d_compat::all_gather_single(*group, gathered, leading);
  if (timeout.count() > 0) {
    TORCH_CHECK(work->wait(timeout), "torchpp.", op_name, ": the all-gather did not complete");
  } else {
    work->wait();
  }
  return gathered.movedim(0, wrapped).contiguous();
}

at::Tensor reduce_scatter_along(
    const at::Tensor& input, int64_t dim, const std::string& group_name, int64_t group_size, const char* op_name) {
  auto group = group_for(input, group_name, group_size, op_name);
  // Checked first: a size that divides on some ranks only must fail on every rank, not hang the others.
  check_same_input(*group, group_name, input, CollectiveKind::ReduceScatter, op_name);
  const int64_t shard = shard_size(input, dim, group_size, op_name);
  const int64_t wrapped = at::maybe_wrap_dim(dim, input.dim());
  auto leading = input.movedim(wrapped, 0).contiguous();
  auto sizes = leading.sizes().vec();
  sizes[0] = shard;
  auto output = at::empty(sizes, leading.options());
  c10d_compat::reduce_scatter_single(*group, output, leading)->wait();
  return output.movedim(0, wrapped).contiguous();
}

at::Tensor split_along(
    const at::Tensor& input, int64_t dim, const std::string& group_name, int64_t group_size, const char* op_name) {
  const int64_t shard = shard_size(input, dim, group_size, op_name);
  auto group = group_for(input, group_name, group_size, op_name);
  const int64_t wrapped = at::maybe_wrap_dim(dim, input.dim());
  // A fresh copy: the op's output may not alias its input.
  return input.narrow(wrapped, group->getRank() * shard, shard).clone(at::MemoryFormat::Contiguous);
}

} // namespace torchpp
