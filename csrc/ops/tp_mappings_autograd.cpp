// Autograd of the TP/SP mappings: each op's backward is its conjugate op, called through the
// dispatcher so that double backward and tracing see torchpp ops all the way down.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

namespace torchpp {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using UnsizedSignature = at::Tensor(const at::Tensor&, c10::string_view);
using SizedSignature = at::Tensor(const at::Tensor&, c10::string_view, int64_t, int64_t);

c10::TypedOperatorHandle<UnsizedSignature> unsized_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<UnsizedSignature>();
}

c10::TypedOperatorHandle<SizedSignature> sized_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<SizedSignature>();
}

// ---- Conjugate pairs: (forward op, the op its backward applies to the gradient) ----
struct CopyToTp {
  static constexpr const char* forward = "torchpp::copy_to_tp_region";
  static constexpr const char* backward = "torchpp::reduce_from_tp_region";
};
struct ReduceFromTp {
  static constexpr const char* forward = "torchpp::reduce_from_tp_region";
  static constexpr const char* backward = "torchpp::copy_to_tp_region";
};
struct ScatterToTp {
  static constexpr const char* forward = "torchpp::scatter_to_tp_region";
  static constexpr const char* backward = "torchpp::gather_from_tp_region";
};
struct GatherFromTp {
  static constexpr const char* forward = "torchpp::gather_from_tp_region";
  static constexpr const char* backward = "torchpp::scatter_to_tp_region";
};
struct ScatterToSp {
  static constexpr const char* forward = "torchpp::scatter_to_sp_region";
  static constexpr const char* backward = "torchpp::gather_from_tp_region";  // a plain all-gather
};
struct GatherFromSp {
  static constexpr const char* forward = "torchpp::gather_from_sp_region";
  static constexpr const char* backward = "torchpp::reduce_scatter_to_sp_region";
};
struct ReduceScatterToSp {
  static constexpr const char* forward = "torchpp::reduce_scatter_to_sp_region";
  static constexpr const char* backward = "torchpp::gather_from_sp_region";
};

template <class Pair>
struct UnsizedMapping : public torch::autograd::Function<UnsizedMapping<Pair>> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, c10::string_view group_name) {
    ctx->saved_data["group_name"] = std::string(group_name);
    at::AutoDispatchBelowADInplaceOrView guard;
    return unsized_op(Pair::forward).call(input, group_name);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto group_name = ctx->saved_data["group_name"].toStringRef();
    return {unsized_op(Pair::backward).call(grads[0], group_name), at::Tensor()};
  }
};

template <class Pair>
struct SizedMapping : public torch::autograd::Function<SizedMapping<Pair>> {
  static at::Tensor forward(
      AutogradContext* ctx, const at::Tensor& input, c10::string_view group_name, int64_t group_size, int64_t dim) {
    ctx->saved_data["group_name"] = std::string(group_name);
    ctx->saved_data["group_size"] = group_size;
    ctx->saved_data["dim"] = dim;
    at::AutoDispatchBelowADInplaceOrView guard;
    return sized_op(Pair::forward).call(input, group_name, group_size, dim);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto group_name = ctx->saved_data["group_name"].toStringRef();
    const auto group_size = ctx->saved_data["group_size"].toInt();
    const auto dim = ctx->saved_data["dim"].toInt();
    return {sized_op(Pair::backward).call(grads[0], group_name, group_size, dim), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

template <class Pair>
at::Tensor apply_unsized(const at::Tensor& input, c10::string_view group_name) {
  return UnsizedMapping<Pair>::apply(input, group_name);
}

template <class Pair>
at::Tensor apply_sized(const at::Tensor& input, c10::string_view group_name, int64_t group_size, int64_t dim) {
  return SizedMapping<Pair>::apply(input, group_name, group_size, dim);
}

} // namespace

// ---- Autograd kernels ----
TORCH_LIBRARY_IMPL(torchpp, Autograd, m) {
  m.impl("copy_to_tp_region", TORCH_FN(apply_unsized<CopyToTp>));
  m.impl("reduce_from_tp_region", TORCH_FN(apply_unsized<ReduceFromTp>));
  m.impl("scatter_to_tp_region", TORCH_FN(apply_sized<ScatterToTp>));
  m.impl("gather_from_tp_region", TORCH_FN(apply_sized<GatherFromTp>));
  m.impl("scatter_to_sp_region", TORCH_FN(apply_sized<ScatterToSp>));
  m.impl("gather_from_sp_region", TORCH_FN(apply_sized<GatherFromSp>));
  m.impl("reduce_scatter_to_sp_region", TORCH_FN(apply_sized<ReduceScatterToSp>));
}

} // namespace torchpp
