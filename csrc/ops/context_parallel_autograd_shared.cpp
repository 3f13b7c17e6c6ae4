// What the attention ops' autograd shares: attention sinks (GPT-OSS's: one learned logit per query
// head in each softmax's denominator, attending to nothing) folded into a finished (out,
// log-sum-exp) and differentiated from them; the call's options kept for the backward.
#include <utility>

#include <ATen/ATen.h>

#include "ops/context_parallel.h"

namespace torchpp::cp {

void check_sinks(const at::Tensor& q, const at::Tensor& sinks, const char* op_name) {
  TORCH_CHECK(sinks.dim() == 1 && sinks.size(0) == q.size(1), "torchpp.", op_name,
              ": sinks must hold one logit per query head, [", q.size(1), "], got ", sinks.sizes());
  TORCH_CHECK(at::isFloatingType(sinks.scalar_type()) && sinks.device() == q.device(), "torchpp.", op_name,
              ": sinks must be floating point on the query's device, got ", sinks.scalar_type(), " on ",
              sinks.device());
}

// A sink adds exp(sink) to each softmax's denominator and nothing to its numerator: the log-sum-exp
// becomes logaddexp(lse, sink), the output shrinks by exp(lse - lse'). The backward's blocks then
// recompute the sinked probabilities from lse' (and rowsum(dO * O') from the sinked output).
std::pair<at::Tensor, at::Tensor> fold_sinks(const at::Tensor& out, const at::Tensor& lse, const at::Tensor& sinks) {
  auto total = at::logaddexp(lse, sinks.to(lse.scalar_type()).view({1, -1, 1}));
  auto kept = at::exp(lse - total).unsqueeze(-1);  // 0 on rows that saw no key (lse = -inf)
  return {out.to(lse.scalar_type()).mul_(kept).to(out.scalar_type()), total};
}

// d loss / d sink_h = -sum over rows of head h of P(sink) * rowsum(dO * O'): the sink's column of
// the softmax backward, whose value row is zero.
at::Tensor sinks_grad(const at::Tensor& grad_out, const at::Tensor& out, const at::Tensor& lse,
                      const at::Tensor& sinks) {
  const auto acc = lse.scalar_type();
  auto delta = (grad_out.to(acc) * out.to(acc)).sum(-1);  // [b, hq, s]
  auto p_sink = at::exp(sinks.to(acc).view({1, -1, 1}) - lse);
  return (p_sink * delta).sum(at::IntArrayRef{0, 2}).neg_().to(sinks.scalar_type());
}

void save_options(SavedData& saved, c10::string_view group_name, int64_t group_size, bool causal,
                  std::optional<double> scale, c10::string_view layout, int64_t window, double softcap) {
  saved["group_name"] = std::string(group_name);
  saved["group_size"] = group_size;
  saved["causal"] = causal;
  saved["scale"] = scale.has_value() ? c10::IValue(*scale) : c10::IValue();
  saved["layout"] = std::string(layout);
  saved["window"] = window;
  saved["softcap"] = softcap;
}

std::optional<double> saved_scale(const SavedData& saved) {
  const auto& value = saved.at("scale");
  return value.isNone() ? std::nullopt : std::optional<double>(value.toDouble());
}

}  // namespace torchpp::cp
