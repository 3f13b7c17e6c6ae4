// Autograd of the split B/W linear: backward computes the input gradient now (the I pass) and,
// while the weight-gradient store captures, parks the weight/bias gradient for the W pass.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include "ops/split_linear_store.h"

namespace torchpp {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using LinearSignature = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&);

// Weight gradient as aten's linear backward forms it: grad^T x over all leading dimensions
// (both given as 2-D matrices, rows = every leading index).
std::pair<at::Tensor, at::Tensor> weight_and_bias_grads(
    const at::Tensor& grad_2d, const at::Tensor& input_2d, bool want_weight, bool want_bias) {
  at::Tensor grad_weight, grad_bias;
  if (want_weight) {
    grad_weight = grad_2d.t().mm(input_2d);
  }
  if (want_bias) {
    grad_bias = grad_2d.sum(0);
  }
  return {grad_weight, grad_bias};
}

bool is_trainable_leaf(const at::Tensor& tensor) {
  return tensor.defined() && tensor.requires_grad() && tensor.is_leaf();
}

struct SplitBWLinear : public torch::autograd::Function<SplitBWLinear> {
  static at::Tensor forward(
      AutogradContext* ctx, const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
    ctx->save_for_backward({input});
    // Kept as the parameter objects themselves: the W pass accumulates into their .grad.
    ctx->saved_data["weight"] = weight;
    ctx->saved_data["bias"] = bias.has_value() ? *bias : at::Tensor();
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("torchpp::split_bw_linear", "")
                         .typed<LinearSignature>();
    return op.call(input, weight, bias);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto input = ctx->get_saved_variables()[0];
    const auto weight = ctx->saved_data["weight"].toTensor();
    const auto bias = ctx->saved_data["bias"].toTensor();
    const auto& grad = grads[0];
    // Rows x features, one copy where the gradient arrives non-contiguous (attention transposes
    // its projections' outputs): matmul would not fold such a gradient and broadcast the weight
    // into a batched GEMM instead, costing more than both GEMMs of the layer.
    const auto grad_2d = grad.reshape({-1, grad.size(-1)});
    const auto input_2d = input.reshape({-1, input.size(-1)});
    at::Tensor grad_input;
    if (ctx->needs_input_grad(0)) {
      grad_input = grad_2d.mm(weight.to(grad.scalar_type())).view(input.sizes());  // the forward's compute dtype
    }
    const bool want_weight = ctx->needs_input_grad(1);
    const bool want_bias = bias.defined() && ctx->needs_input_grad(2);
    const bool deferrable = is_trainable_leaf(weight) && (!want_bias || is_trainable_leaf(bias));
    if (deferrable && (want_weight || want_bias)) {
      bool parked = weight_grad_store::defer([grad_2d, input_2d, weight, bias, want_weight, want_bias]() {
        auto [grad_weight, grad_bias] = weight_and_bias_grads(grad_2d, input_2d, want_weight, want_bias);
        if (want_weight) weight_grad_store::accumulate(weight, grad_weight);
        if (want_bias) weight_grad_store::accumulate(bias, grad_bias);
      });
      if (parked) {
        if (want_weight) weight_grad_store::note_parked(weight);
        if (want_bias) weight_grad_store::note_parked(bias);
        return {grad_input, at::Tensor(), at::Tensor()};
      }
    }
    // In the compute dtype; autograd casts them to the parameters' dtype, as after autocast's linear.
    auto [grad_weight, grad_bias] = weight_and_bias_grads(grad_2d, input_2d, want_weight, want_bias);
    return {grad_input, grad_weight, grad_bias};
  }
};

at::Tensor split_bw_linear_autograd(
    const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  return SplitBWLinear::apply(input, weight, bias);
}

}  // namespace

// ---- Autograd kernel ----
TORCH_LIBRARY_IMPL(torchpp, Autograd, m) {
  m.impl("split_bw_linear", TORCH_FN(split_bw_linear_autograd));
}

}  // namespace torchpp
