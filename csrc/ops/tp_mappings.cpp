// Forward kernels (all devices) and fake/meta kernels of the TP/SP mappings.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops/collectives.h"

namespace torchpp {
namespace {

// ---- Device-generic forward kernels ----

at::Tensor copy_to_tp_region(const at::Tensor& input, c10::string_view group_name) {
  // No communication forward, but a bad group must fail here rather than in backward.
  check_group(input, std::string(group_name), "copy_to_tp_region");
  return input.clone(at::MemoryFormat::Contiguous);  // (every mapping's output is contiguous, as its fake's)
}

at::Tensor reduce_from_tp_region(const at::Tensor& input, c10::string_view group_name) {
  return all_reduce_sum(input, std::string(group_name), "reduce_from_tp_region");
}

at::Tensor scatter_to_tp_region(const at::Tensor& input, c10::string_view group_name, int64_t group_size, int64_t dim) {
  return split_along(input, dim, std::string(group_name), group_size, "scatter_to_tp_region");
}

at::Tensor gather_from_tp_region(const at::Tensor& input, c10::string_view group_name, int64_t group_size, int64_t dim) {
  return all_gather_along(input, dim, std::string(group_name), group_size, "gather_from_tp_region");
}

at::Tensor scatter_to_sp_region(const at::Tensor& input, c10::string_view group_name, int64_t group_size, int64_t dim) {
  return split_along(input, dim, std::string(group_name), group_size, "scatter_to_sp_region");
}

at::Tensor gather_from_sp_region(const at::Tensor& input, c10::string_view group_name, int64_t group_size, int64_t dim) {
  return all_gather_along(input, dim, std::string(group_name), group_size, "gather_from_sp_region");
}

at::Tensor reduce_scatter_to_sp_region(
    const at::Tensor& input, c10::string_view group_name, int64_t group_size, int64_t dim) {
  return reduce_scatter_along(input, dim, std::string(group_name), group_size, "reduce_scatter_to_sp_region");
}

// ---- Fake kernels: shapes only, from the explicit group_size; never touch a group ----
// Outputs contiguous whatever the input's strides, as the kernels return them.

at::Tensor same_shape_fake(const at::Tensor& input, c10::string_view) {
  return at::empty_symint(input.sym_sizes(), input.options());
}

at::Tensor resized_fake(const at::Tensor& input, int64_t group_size, int64_t dim, bool shrink, const char* op_name) {
  TORCH_CHECK(group_size > 0, "torchpp.", op_name, ": group_size must be positive, got ", group_size);
  const int64_t wrapped = at::maybe_wrap_dim(dim, input.dim());
  auto sizes = input.sym_sizes().vec();
  if (shrink) {
    const auto& size = sizes[wrapped];
    if (!size.is_symbolic()) {
      shard_size(input, dim, group_size, op_name);  // raises with the values when it does not divide
    }
    sizes[wrapped] = size / group_size;
  } else {
    sizes[wrapped] = sizes[wrapped] * group_size;
  }
  return at::empty_symint(sizes, input.options());
}

at::Tensor shrink_fake_tp(const at::Tensor& input, c10::string_view, int64_t group_size, int64_t dim) {
  return resized_fake(input, group_size, dim, /*shrink=*/true, "scatter_to_tp_region");
}
at::Tensor grow_fake_tp(const at::Tensor& input, c10::string_view, int64_t group_size, int64_t dim) {
  return resized_fake(input, group_size, dim, /*shrink=*/false, "gather_from_tp_region");
}
at::Tensor shrink_fake_sp(const at::Tensor& input, c10::string_view, int64_t group_size, int64_t dim) {
  return resized_fake(input, group_size, dim, /*shrink=*/true, "scatter_to_sp_region");
}
at::Tensor grow_fake_sp(const at::Tensor& input, c10::string_view, int64_t group_size, int64_t dim) {
  return resized_fake(input, group_size, dim, /*shrink=*/false, "gather_from_sp_region");
}
at::Tensor reduce_scatter_fake(const at::Tensor& input, c10::string_view, int64_t group_size, int64_t dim) {
  return resized_fake(input, group_size, dim, /*shrink=*/true, "reduce_scatter_to_sp_region");
}

} // namespace

// ---- Registration: forward kernels for every device, fake kernels on Meta ----
TORCH_LIBRARY_IMPL(torchpp, CompositeExplicitAutograd, m) {
  m.impl("copy_to_tp_region", TORCH_FN(copy_to_tp_region));
  m.impl("reduce_from_tp_region", TORCH_FN(reduce_from_tp_region));
  m.impl("scatter_to_tp_region", TORCH_FN(scatter_to_tp_region));
  m.impl("gather_from_tp_region", TORCH_FN(gather_from_tp_region));
  m.impl("scatter_to_sp_region", TORCH_FN(scatter_to_sp_region));
  m.impl("gather_from_sp_region", TORCH_FN(gather_from_sp_region));
  m.impl("reduce_scatter_to_sp_region", TORCH_FN(reduce_scatter_to_sp_region));
}

TORCH_LIBRARY_IMPL(torchpp, Meta, m) {
  m.impl("copy_to_tp_region", TORCH_FN(same_shape_fake));
  m.impl("reduce_from_tp_region", TORCH_FN(same_shape_fake));
  m.impl("scatter_to_tp_region", TORCH_FN(shrink_fake_tp));
  m.impl("gather_from_tp_region", TORCH_FN(grow_fake_tp));
  m.impl("scatter_to_sp_region", TORCH_FN(shrink_fake_sp));
  m.impl("gather_from_sp_region", TORCH_FN(grow_fake_sp));
  m.impl("reduce_scatter_to_sp_region", TORCH_FN(reduce_scatter_fake));
}

} // namespace torchpp
