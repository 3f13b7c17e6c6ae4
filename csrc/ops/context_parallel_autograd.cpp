// Autograd of ring_attention and all_gather_attention: forward calls the mode's *_forward op
// (output and log-sum-exp; scores capped there), folds in the attention sinks if any, and saves q, k, v, the output
// and the log-sum-exp; backward calls its *_backward op, which recomputes each block's
// probabilities, and computes the sinks' gradient. Also the calls without autograd and the fake
// (meta) kernels.
#include <tuple>

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include "ops/context_parallel.h"

namespace torchpp::cp {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using ForwardSignature = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                            const std::optional<at::Tensor>&, c10::string_view,
                                                            int64_t, bool, std::optional<double>, c10::string_view,
                                                            int64_t, double, const std::optional<at::Tensor>&);
using BackwardSignature = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const std::optional<at::Tensor>&, c10::string_view, int64_t, bool, std::optional<double>, c10::string_view,
    int64_t, double, const std::optional<at::Tensor>&);

struct Ring {
  static constexpr const char* name = "ring_attention";
  static constexpr const char* forward = "torchpp::ring_attention_forward";
  static constexpr const char* backward = "torchpp::ring_attention_backward";
};
struct AllGather {
  static constexpr const char* name = "all_gather_attention";
  static constexpr const char* forward = "torchpp::all_gather_attention_forward";
  static constexpr const char* backward = "torchpp::all_gather_attention_backward";
};

template <class Mode>
c10::TypedOperatorHandle<ForwardSignature> forward_op() {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow(Mode::forward, "").template typed<ForwardSignature>();
  return op;
}

template <class Mode>
c10::TypedOperatorHandle<BackwardSignature> backward_op() {
  static auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow(Mode::backward, "").template typed<BackwardSignature>();
  return op;
}

template <class Mode>
struct Attention : public torch::autograd::Function<Attention<Mode>> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const std::optional<at::Tensor>& segment_ids, c10::string_view group_name,
                            int64_t group_size, bool causal, std::optional<double> scale,
                            c10::string_view layout, int64_t window, const std::optional<at::Tensor>& sinks,
                            double softcap, const std::optional<at::Tensor>& alibi_slopes) {
    at::Tensor out, lse;
    {
      at::AutoDispatchBelowADInplaceOrView guard;  // (the sinks' fold below stays above it, as backward's code)
      std::tie(out, lse) = forward_op<Mode>().call(q, k, v, segment_ids, group_name, group_size, causal, scale,
                                                   layout, window, softcap, alibi_slopes);
    }
    if (has(sinks)) {
      check_sinks(q, *sinks, Mode::name);
      std::tie(out, lse) = fold_sinks(out, lse, *sinks);
    }
    ctx->save_for_backward({q, k, v, out, lse, segment_ids.value_or(at::Tensor()), sinks.value_or(at::Tensor()),
                            alibi_slopes.value_or(at::Tensor())});
    save_options(ctx->saved_data, group_name, group_size, causal, scale, layout, window, softcap);
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const auto group_name = ctx->saved_data["group_name"].toStringRef();
    const auto layout = ctx->saved_data["layout"].toStringRef();
    const std::optional<double> scale = saved_scale(ctx->saved_data);
    std::optional<at::Tensor> segment_ids = saved[5].defined() ? std::optional<at::Tensor>(saved[5]) : std::nullopt;
    std::optional<at::Tensor> alibi_slopes = saved[7].defined() ? std::optional<at::Tensor>(saved[7]) : std::nullopt;
    // Every rank of the group must take part in the exchange, even one whose output got no gradient.
    auto grad_out = grads[0].defined() ? grads[0] : at::zeros_like(saved[3]);
    auto [dq, dk, dv] = backward_op<Mode>().call(grad_out, saved[0], saved[1], saved[2], saved[3], saved[4],
                                                  segment_ids, group_name, ctx->saved_data["group_size"].toInt(),
                                                  ctx->saved_data["causal"].toBool(), scale, layout,
                                                  ctx->saved_data["window"].toInt(),
                                                  ctx->saved_data["softcap"].toDouble(), alibi_slopes);
    auto dsinks = saved[6].defined() ? sinks_grad(grad_out, saved[3], saved[4], saved[6]) : at::Tensor();
    return {dq, dk, dv, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor(), dsinks, at::Tensor(), at::Tensor()};
  }
};

template <class Mode>
at::Tensor attention_autograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const std::optional<at::Tensor>& segment_ids, c10::string_view group_name,
                              int64_t group_size, bool causal, std::optional<double> scale, c10::string_view layout,
                              int64_t window, const std::optional<at::Tensor>& sinks, double softcap,
                              const std::optional<at::Tensor>& alibi_slopes) {
  return Attention<Mode>::apply(q, k, v, segment_ids, group_name, group_size, causal, scale, layout, window, sinks,
                                softcap, alibi_slopes);
}

// Without autograd: the forward op's output (sinks folded in) alone.
template <class Mode>
at::Tensor attention_no_grad(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const std::optional<at::Tensor>& segment_ids, c10::string_view group_name,
                             int64_t group_size, bool causal, std::optional<double> scale, c10::string_view layout,
                             int64_t window, const std::optional<at::Tensor>& sinks, double softcap,
                             const std::optional<at::Tensor>& alibi_slopes) {
  auto [out, lse] = forward_op<Mode>().call(q, k, v, segment_ids, group_name, group_size, causal, scale, layout,
                                            window, softcap, alibi_slopes);
  if (!has(sinks)) {
    return out;
  }
  check_sinks(q, *sinks, Mode::name);
  return fold_sinks(out, lse, *sinks).first;
}

// ---- Fake kernels: shapes from the inputs alone; never touch a group ----

at::ScalarType acc_dtype(const at::Tensor& q) {
  const auto dtype = q.scalar_type();
  return (dtype == at::kHalf || dtype == at::kBFloat16) ? at::kFloat : dtype;
}

// Contiguous, whatever the inputs' strides, as the kernels return them (a compiled graph plans its views
// by these strides: an output laid out as a transposed query would mislead them).
at::Tensor contiguous_like(const at::Tensor& t) {
  return at::empty_symint(t.sym_sizes(), t.options());
}

at::Tensor attention_fake(const at::Tensor& q, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                          c10::string_view, int64_t, bool, std::optional<double>, c10::string_view, int64_t,
                          const std::optional<at::Tensor>&, double, const std::optional<at::Tensor>&) {
  return contiguous_like(q);
}

std::tuple<at::Tensor, at::Tensor> forward_fake(const at::Tensor& q, const at::Tensor&, const at::Tensor&,
                                                const std::optional<at::Tensor>&, c10::string_view, int64_t, bool,
                                                std::optional<double>, c10::string_view, int64_t, double,
                                                const std::optional<at::Tensor>&) {
  return {contiguous_like(q), at::empty_symint(q.sym_sizes().slice(0, 3), q.options().dtype(acc_dtype(q)))};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_fake(
    const at::Tensor&, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor&,
    const at::Tensor&, const std::optional<at::Tensor>&, c10::string_view, int64_t, bool, std::optional<double>,
    c10::string_view, int64_t, double, const std::optional<at::Tensor>&) {
  return {contiguous_like(q), contiguous_like(k), contiguous_like(v)};
}

}  // namespace

// ---- Autograd kernels ----
TORCH_LIBRARY_IMPL(torchpp, Autograd, m) {
  m.impl("ring_attention", TORCH_FN(attention_autograd<Ring>));
  m.impl("all_gather_attention", TORCH_FN(attention_autograd<AllGather>));
}

// ---- Below autograd (no_grad, inference): the forward op's output ----
TORCH_LIBRARY_IMPL(torchpp, CompositeExplicitAutograd, m) {
  m.impl("ring_attention", TORCH_FN(attention_no_grad<Ring>));
  m.impl("all_gather_attention", TORCH_FN(attention_no_grad<AllGather>));
}

// ---- Fake kernels on Meta ----
TORCH_LIBRARY_IMPL(torchpp, Meta, m) {
  m.impl("ring_attention", TORCH_FN(attention_fake));
  m.impl("all_gather_attention", TORCH_FN(attention_fake));
  m.impl("ring_attention_forward", TORCH_FN(forward_fake));
  m.impl("all_gather_attention_forward", TORCH_FN(forward_fake));
  m.impl("ring_attention_backward", TORCH_FN(backward_fake));
  m.impl("all_gather_attention_backward", TORCH_FN(backward_fake));
}

}  // namespace torchpp::cp
