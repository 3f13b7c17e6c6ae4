// Forward kernels (all devices) of the expert-parallel ops: routing, dispatch and combine.
#include "ops/expert_parallel.h"

#include <cmath>
#include <tuple>

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/library.h>

#include "ops/c10d_compat.h"
#include "ops/collective_check.h"
#include "ops/process_group.h"

namespace torchpp::ep {

std::vector<int64_t> rows_per_rank(const at::Tensor& counts, int64_t group_size) {
  auto per_rank = counts.to(at::kCPU, at::kLong).reshape({group_size, -1}).sum(1).contiguous();
  return std::vector<int64_t>(per_rank.data_ptr<int64_t>(), per_rank.data_ptr<int64_t>() + group_size);
}

at::Tensor exchange_rows(const at::Tensor& rows, const std::vector<int64_t>& send_rows,
                         const std::vector<int64_t>& recv_rows, const std::string& group_name, int64_t group_size,
                         const char* op_name) {
  auto group = resolve_group(group_name);
  check_group_size(*group, group_name, group_size, op_name);
  check_device_supported(*group, group_name, rows, op_name);
  int64_t sent = 0, received = 0;
  for (auto n : send_rows) sent += n;
  for (auto n : recv_rows) received += n;
  TORCH_CHECK(rows.size(0) == sent, "torchpp.", op_name, ": ", rows.size(0), " rows for send counts summing to ",
              sent);
  auto input = rows.contiguous();
  if (group_size == 1) {
    return input.clone();
  }
  auto sizes = input.sizes().vec();
  sizes[0] = received;
  auto output = at::empty(sizes, input.options());
  // The split sizes came from moe_route's exchange, so every rank's sends match its peers' receives:
  // no shape check can apply (the ranks' shapes differ by design).
  auto send = send_rows, recv = recv_rows;
  RECORD_FUNCTION("torchpp::moe::all_to_all", std::vector<c10::IValue>());  // the span overlap is measured on
  c10d_compat::all_to_all_single(*group, output, input, recv, send)->wait();
  return output;
}

at::Tensor expert_major_index(const at::Tensor& recv_counts) {
  auto counts = recv_counts.to(at::kCPU, at::kLong).contiguous();
  const int64_t sources = counts.size(0), experts = counts.size(1);
  auto c = counts.accessor<int64_t, 2>();
  std::vector<int64_t> start(sources * experts);
  int64_t offset = 0;
  for (int64_t s = 0; s < sources; ++s) {
    for (int64_t e = 0; e < experts; ++e) {
      start[s * experts + e] = offset;
      offset += c[s][e];
    }
  }
  std::vector<int64_t> index;
  index.reserve(offset);
  for (int64_t e = 0; e < experts; ++e) {
    for (int64_t s = 0; s < sources; ++s) {
      for (int64_t i = 0; i < c[s][e]; ++i) index.push_back(start[s * experts + e] + i);
    }
  }
  return at::tensor(index, at::TensorOptions().dtype(at::kLong)).to(recv_counts.device());
}

namespace {

void check_counts(const at::Tensor& send_counts, const at::Tensor& recv_counts, int64_t group_size,
                  const char* op_name) {
  TORCH_CHECK(group_size > 0, "torchpp.", op_name, ": group_size must be positive, got ", group_size);
  TORCH_CHECK(send_counts.dim() == 1 && send_counts.numel() % group_size == 0, "torchpp.", op_name,
              ": send_counts must be [num_experts] with num_experts divisible by group_size=", group_size,
              ", got shape ", send_counts.sizes());
  TORCH_CHECK(recv_counts.dim() == 2 && recv_counts.size(0) == group_size &&
                  recv_counts.size(1) * group_size == send_counts.numel(),
              "torchpp.", op_name, ": recv_counts must be [group_size, num_experts / group_size] = [", group_size,
              ", ", send_counts.numel() / group_size, "], got shape ", recv_counts.sizes());
}

at::Tensor token_of(const at::Tensor& order, int64_t top_k) {
  return at::div(order, top_k, "floor");
}

// ---- moe_route ----
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_route(
    const at::Tensor& expert_index, int64_t num_experts, c10::string_view group_name, int64_t group_size,
    std::optional<double> capacity_factor) {
  const char* op = "moe_route";
  TORCH_CHECK(expert_index.dim() == 2, "torchpp.moe_route: expert_index must be [tokens, top_k], got shape ",
              expert_index.sizes());
  TORCH_CHECK(!expert_index.is_floating_point() && !expert_index.is_complex() &&
                  expert_index.scalar_type() != at::kBool,
              "torchpp.moe_route: expert_index must hold integers, got ", expert_index.scalar_type());
  TORCH_CHECK(group_size > 0, "torchpp.moe_route: group_size must be positive, got ", group_size);
  TORCH_CHECK(num_experts > 0 && num_experts % group_size == 0, "torchpp.moe_route: num_experts=", num_experts,
              " must be a positive multiple of the group size ", group_size, " (each rank holds whole experts)");
  auto flat = expert_index.reshape({-1}).to(at::kLong);
  const int64_t pairs = flat.numel();
  if (pairs > 0) {
    const auto bounds = at::stack({flat.min(), flat.max()}).to(at::kCPU);  // one device-to-host read
    const int64_t low = bounds[0].item<int64_t>(), high = bounds[1].item<int64_t>();
    TORCH_CHECK(low >= 0 && high < num_experts, "torchpp.moe_route: expert indices must lie in [0, num_experts=",
                num_experts, "), got values from ", low, " to ", high);
  }
  auto order = at::argsort(flat, /*stable=*/true);
  auto counts = at::bincount(flat, {}, num_experts).to(at::kLong);
  int64_t dropped = 0;
  if (capacity_factor.has_value()) {
    TORCH_CHECK(*capacity_factor > 0, "torchpp.moe_route: capacity_factor must be positive, got ", *capacity_factor);
    // Switch Transformer's capacity: an even share of this rank's pairs, times the factor.
    const auto capacity = static_cast<int64_t>(std::ceil(*capacity_factor * pairs / num_experts));
    auto starts = at::cumsum(counts, 0) - counts;
    auto position = at::arange(pairs, flat.options()) - starts.index_select(0, flat.index_select(0, order));
    order = order.masked_select(position < capacity);
    auto kept = counts.clamp_max(capacity);
    dropped = pairs - kept.sum().item<int64_t>();
    counts = kept;
  }
  const std::string name(group_name);
  auto group = resolve_group(name);
  check_group_size(*group, name, group_size, op);
  check_device_supported(*group, name, counts, op);
  at::Tensor received;
  if (group_size == 1) {
    received = counts.clone();
  } else {
    // A different num_experts on some rank would make the exchange's buffers disagree: checked first.
    RECORD_FUNCTION("torchpp::moe::all_to_all", std::vector<c10::IValue>());
    check_same_input(*group, name, counts, CollectiveKind::AllToAll, op);
    received = at::empty_like(counts);
    std::vector<int64_t> even;
    c10d_compat::all_to_all_single(*group, received, counts, even, even)->wait();
  }
  return {order, counts, received.view({group_size, num_experts / group_size}),
          at::scalar_tensor(dropped, counts.options())};
}

// ---- moe_dispatch and its backward ----
at::Tensor moe_dispatch(const at::Tensor& hidden, const at::Tensor& order, const at::Tensor& send_counts,
                        const at::Tensor& recv_counts, int64_t top_k, c10::string_view group_name,
                        int64_t group_size) {
  const char* op = "moe_dispatch";
  TORCH_CHECK(hidden.dim() == 2, "torchpp.moe_dispatch: hidden must be [tokens, hidden], got shape ", hidden.sizes());
  TORCH_CHECK(top_k > 0, "torchpp.moe_dispatch: top_k must be positive, got ", top_k);
  check_counts(send_counts, recv_counts, group_size, op);
  auto rows = hidden.index_select(0, token_of(order, top_k));
  auto arrived = exchange_rows(rows, rows_per_rank(send_counts, group_size), rows_per_rank(recv_counts, group_size),
                               std::string(group_name), group_size, op);
  return arrived.index_select(0, expert_major_index(recv_counts));
}

// Expert-major rows back to the ranks they came from, in the order they left (order's).
at::Tensor return_rows(const at::Tensor& rows, const at::Tensor& send_counts, const at::Tensor& recv_counts,
                       c10::string_view group_name, int64_t group_size, const char* op) {
  check_counts(send_counts, recv_counts, group_size, op);
  auto index = expert_major_index(recv_counts);
  TORCH_CHECK(rows.dim() == 2 && rows.size(0) == index.numel(), "torchpp.", op, ": expected [", index.numel(),
              ", hidden] rows (what moe_dispatch gave), got shape ", rows.sizes());
  auto source_major = at::empty_like(rows, at::MemoryFormat::Contiguous).index_copy_(0, index, rows);
  return exchange_rows(source_major, rows_per_rank(recv_counts, group_size), rows_per_rank(send_counts, group_size),
                       std::string(group_name), group_size, op);
}

at::Tensor moe_undispatch(const at::Tensor& rows, const at::Tensor& order, const at::Tensor& send_counts,
                          const at::Tensor& recv_counts, int64_t top_k, int64_t num_tokens,
                          c10::string_view group_name, int64_t group_size) {
  auto back = return_rows(rows, send_counts, recv_counts, group_name, group_size, "moe_undispatch");
  return at::zeros({num_tokens, rows.size(1)}, back.options()).index_add_(0, token_of(order, top_k), back);
}

// ---- moe_combine's halves ----
std::tuple<at::Tensor, at::Tensor> moe_combine_forward(
    const at::Tensor& expert_output, const at::Tensor& weights, const at::Tensor& order, const at::Tensor& send_counts,
    const at::Tensor& recv_counts, int64_t num_tokens, c10::string_view group_name, int64_t group_size) {
  const char* op = "moe_combine";
  TORCH_CHECK(weights.dim() == 2 && weights.size(0) == num_tokens, "torchpp.moe_combine: weights must be [num_tokens=",
              num_tokens, ", top_k], got shape ", weights.sizes());
  auto back = return_rows(expert_output, send_counts, recv_counts, group_name, group_size, op);
  auto weight = weights.reshape({-1}).index_select(0, order).unsqueeze(1);
  // As transformers' experts: the product in the promoted dtype, summed in the rows' own.
  auto weighted = (back * weight).to(back.scalar_type());
  auto out = at::zeros({num_tokens, back.size(1)}, back.options())
                 .index_add_(0, token_of(order, weights.size(1)), weighted);
  return {out, back};
}

std::tuple<at::Tensor, at::Tensor> moe_combine_backward(
    const at::Tensor& grad_out, const at::Tensor& returned, const at::Tensor& weights, const at::Tensor& order,
    const at::Tensor& send_counts, const at::Tensor& recv_counts, c10::string_view group_name, int64_t group_size) {
  const char* op = "moe_combine_backward";
  check_counts(send_counts, recv_counts, group_size, op);
  auto grad_rows = grad_out.index_select(0, token_of(order, weights.size(1)));
  auto weight = weights.reshape({-1}).index_select(0, order);
  const auto promoted = at::result_type(returned, weights);
  auto grad_weight_rows = (grad_rows.to(promoted) * returned.to(promoted)).sum(1);
  auto grad_weights = at::zeros({weights.numel()}, weights.options())
                          .index_copy_(0, order, grad_weight_rows.to(weights.scalar_type()))
                          .view(weights.sizes());
  auto grad_back = (grad_rows * weight.unsqueeze(1)).to(returned.scalar_type());
  auto arrived = exchange_rows(grad_back, rows_per_rank(send_counts, group_size),
                               rows_per_rank(recv_counts, group_size), std::string(group_name), group_size, op);
  return {arrived.index_select(0, expert_major_index(recv_counts)), grad_weights};
}

}  // namespace

// ---- Device-generic kernels ----
TORCH_LIBRARY_IMPL(torchpp, CompositeExplicitAutograd, m) {
  m.impl("moe_route", TORCH_FN(moe_route));
  m.impl("moe_undispatch", TORCH_FN(moe_undispatch));
  m.impl("moe_combine_forward", TORCH_FN(moe_combine_forward));
  m.impl("moe_combine_backward", TORCH_FN(moe_combine_backward));
  m.impl("moe_dispatch", TORCH_FN(moe_dispatch));  // below autograd (expert_parallel_autograd.cpp)
}

}  // namespace torchpp::ep
