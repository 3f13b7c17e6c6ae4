// Autograd of moe_dispatch and moe_combine: each backward is the opposite all-to-all, called
// through the dispatcher (moe_undispatch, moe_combine_backward). Also moe_combine without autograd.
#include <tuple>

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

namespace torchpp::ep {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using DispatchSignature = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                     int64_t, c10::string_view, int64_t);
using UndispatchSignature = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                       int64_t, int64_t, c10::string_view, int64_t);
using CombineForwardSignature = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                                   const at::Tensor&, const at::Tensor&,
                                                                   const at::Tensor&, int64_t, c10::string_view,
                                                                   int64_t);
using CombineBackwardSignature = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                                    const at::Tensor&, const at::Tensor&,
                                                                    const at::Tensor&, const at::Tensor&,
                                                                    c10::string_view, int64_t);

template <class Signature>
c10::TypedOperatorHandle<Signature> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

struct Dispatch : public torch::autograd::Function<Dispatch> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& hidden, const at::Tensor& order,
                            const at::Tensor& send_counts, const at::Tensor& recv_counts, int64_t top_k,
                            c10::string_view group_name, int64_t group_size) {
    ctx->save_for_backward({order, send_counts, recv_counts});
    ctx->saved_data["top_k"] = top_k;
    ctx->saved_data["num_tokens"] = hidden.size(0);
    ctx->saved_data["group_name"] = std::string(group_name);
    ctx->saved_data["group_size"] = group_size;
    at::AutoDispatchBelowADInplaceOrView guard;
    return op<DispatchSignature>("torchpp::moe_dispatch")
        .call(hidden, order, send_counts, recv_counts, top_k, group_name, group_size);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const auto group_name = ctx->saved_data["group_name"].toStringRef();
    const auto group_size = ctx->saved_data["group_size"].toInt();
    auto grad = grads[0];
    TORCH_CHECK(grad.defined(), "torchpp.moe_dispatch: backward without a gradient of the dispatched rows");
    auto grad_hidden = op<UndispatchSignature>("torchpp::moe_undispatch")
                           .call(grad, saved[0], saved[1], saved[2], ctx->saved_data["top_k"].toInt(),
                                 ctx->saved_data["num_tokens"].toInt(), group_name, group_size);
    return {grad_hidden, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

struct Combine : public torch::autograd::Function<Combine> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& expert_output, const at::Tensor& weights,
                            const at::Tensor& order, const at::Tensor& send_counts, const at::Tensor& recv_counts,
                            int64_t num_tokens, c10::string_view group_name, int64_t group_size) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, returned] = op<CombineForwardSignature>("torchpp::moe_combine_forward")
                               .call(expert_output, weights, order, send_counts, recv_counts, num_tokens, group_name,
                                     group_size);
    ctx->save_for_backward({returned, weights, order, send_counts, recv_counts});
    ctx->saved_data["group_name"] = std::string(group_name);
    ctx->saved_data["group_size"] = group_size;
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    TORCH_CHECK(grads[0].defined(), "torchpp.moe_combine: backward without a gradient of the output");
    auto [grad_rows, grad_weights] =
        op<CombineBackwardSignature>("torchpp::moe_combine_backward")
            .call(grads[0], saved[0], saved[1], saved[2], saved[3], saved[4],
                  ctx->saved_data["group_name"].toStringRef(), ctx->saved_data["group_size"].toInt());
    return {grad_rows, grad_weights, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor()};
  }
};

at::Tensor dispatch_autograd(const at::Tensor& hidden, const at::Tensor& order, const at::Tensor& send_counts,
                             const at::Tensor& recv_counts, int64_t top_k, c10::string_view group_name,
                             int64_t group_size) {
  return Dispatch::apply(hidden, order, send_counts, recv_counts, top_k, group_name, group_size);
}

at::Tensor combine_autograd(const at::Tensor& expert_output, const at::Tensor& weights, const at::Tensor& order,
                            const at::Tensor& send_counts, const at::Tensor& recv_counts, int64_t num_tokens,
                            c10::string_view group_name, int64_t group_size) {
  return Combine::apply(expert_output, weights, order, send_counts, recv_counts, num_tokens, group_name, group_size);
}

// Without autograd: the forward half's output alone.
at::Tensor combine_no_grad(const at::Tensor& expert_output, const at::Tensor& weights, const at::Tensor& order,
                           const at::Tensor& send_counts, const at::Tensor& recv_counts, int64_t num_tokens,
                           c10::string_view group_name, int64_t group_size) {
  return std::get<0>(op<CombineForwardSignature>("torchpp::moe_combine_forward")
                         .call(expert_output, weights, order, send_counts, recv_counts, num_tokens, group_name,
                               group_size));
}

}  // namespace

// ---- Autograd kernels ----
TORCH_LIBRARY_IMPL(torchpp, Autograd, m) {
  m.impl("moe_dispatch", TORCH_FN(dispatch_autograd));
  m.impl("moe_combine", TORCH_FN(combine_autograd));
}

// ---- Below autograd (no_grad, inference) ----
TORCH_LIBRARY_IMPL(torchpp, CompositeExplicitAutograd, m) {
  m.impl("moe_combine", TORCH_FN(combine_no_grad));
}

}  // namespace torchpp::ep
