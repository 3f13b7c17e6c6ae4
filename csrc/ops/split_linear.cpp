// Forward kernel of the split B/W linear (all devices; meta/fake shapes come from at::linear).
#include <ATen/ATen.h>
#include <torch/library.h>

namespace torchpp {
namespace {

at::Tensor split_bw_linear(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  return at::linear(input, weight, bias);
}

}  // namespace

// ---- Device-generic forward ----
TORCH_LIBRARY_IMPL(torchpp, CompositeExplicitAutograd, m) {
  m.impl("split_bw_linear", TORCH_FN(split_bw_linear));
}

}  // namespace torchpp
