// Forward kernel of the split B/W linear (all devices; meta/fake shapes come from at::linear),
// and its autocast kernel.
#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

namespace torchpp {
namespace {

using LinearSignature = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&);

// Computes in the input's dtype, weight and bias cast to it, as autocast's linear does; the
// parameters themselves reach autograd uncast, so their gradients can still be deferred.
at::Tensor split_bw_linear(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  const auto dtype = input.scalar_type();
  std::optional<at::Tensor> cast_bias;
  if (bias.has_value() && bias->defined()) {
    cast_bias = bias->to(dtype);
  }
  if (input.dim() <= 2) {
    return at::linear(input, weight.to(dtype), cast_bias);
  }
  // As rows x features (one copy where the input is non-contiguous, as attention's transposed
  // projections are): at::linear hands such an input to matmul, which below autograd does not
  // fold it but broadcasts the weight into a batched GEMM, several times slower.
  auto sizes = input.sym_sizes().vec();
  sizes.back() = weight.sym_size(0);
  const auto rows = input.reshape_symint({c10::SymInt(-1), input.sym_size(-1)});
  return at::linear(rows, weight.to(dtype), cast_bias).view_symint(sizes);
}

// Autocast casts only the input to the region's dtype; the op casts the weight (above).
template <c10::DeviceType device_type>
at::Tensor split_bw_linear_autocast(
    const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(at::autocast::get_autocast_dispatch_key_from_device_type(device_type));
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("torchpp::split_bw_linear", "")
                       .typed<LinearSignature>();
  // autocast's own rule: floating tensors of the device, never float64.
  const bool eligible = at::autocast::is_autocast_eligible(input, device_type) && input.scalar_type() != at::kDouble;
  return op.call(eligible ? input.to(at::autocast::get_autocast_dtype(device_type)) : input, weight, bias);
}

}  // namespace

// ---- Device-generic forward ----
TORCH_LIBRARY_IMPL(torchpp, CompositeExplicitAutograd, m) {
  m.impl("split_bw_linear", TORCH_FN(split_bw_linear));
}

// ---- Autocast: one kernel, registered per device's autocast key ----
TORCH_LIBRARY_IMPL(torchpp, AutocastCPU, m) {
  m.impl("split_bw_linear", TORCH_FN(split_bw_linear_autocast<c10::DeviceType::CPU>));
}

TORCH_LIBRARY_IMPL(torchpp, AutocastCUDA, m) {
  m.impl("split_bw_linear", TORCH_FN(split_bw_linear_autocast<c10::DeviceType::CUDA>));
}

}  // namespace torchpp
