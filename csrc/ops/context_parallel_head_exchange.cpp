// The all-to-all attention modes' exchange of heads for the sequence (DeepSpeed-Ulysses), as two ops
// (torch.ops.torchpp.heads_to_sequence / sequence_to_heads), each the other's gradient: this rank's
// shard of every head in, its 1/c of the heads over the whole sequence out, and back. Being ops, a
// trace (torch.compile) records an exchange as one node that runs the collective, rather than
// tracing into c10d's in-place calls, whose writes a functional graph would drop.
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/record_function.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/library.h>

#include "ops/c10d_compat.h"
#include "ops/context_parallel.h"

namespace torchpp::cp {
namespace {

constexpr const char* kToSequence = "heads_to_sequence";
constexpr const char* kToHeads = "sequence_to_heads";

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// An all-to-all of equal parts: slice j of `send` [c, ...] goes to rank j; slice j of the result
// came from rank j.
at::Tensor exchange(c10d::ProcessGroup& group, const at::Tensor& send) {
  RECORD_FUNCTION("torchpp::cp::all_to_all", std::vector<c10::IValue>());
  auto input = send.contiguous();
  auto output = at::empty_like(input);
  auto flat_in = input.view({-1});  // flat buffers: what every backend accepts
  auto flat_out = output.view({-1});
  std::vector<int64_t> equal;  // (no splits: equal parts)
  c10d_compat::all_to_all_single(group, flat_out, flat_in, equal, equal)->wait();
  return output;
}

// (rank, piece) holding each chunk of the sequence, in sequence order.
std::vector<std::pair<int64_t, int64_t>> owners(int64_t c, Layout layout) {
  std::vector<std::pair<int64_t, int64_t>> owner(layout == Layout::Zigzag ? 2 * c : c);
  for (int64_t r = 0; r < c; ++r) {
    const auto held = chunks_of(r, c, layout);
    for (int64_t p = 0; p < static_cast<int64_t>(held.size()); ++p) {
      owner[held[p]] = {r, p};
    }
  }
  return owner;
}

// Every rank's shard of `x` [c, b, ..., s_local (dim seq_dim + 1), ...] (rank-major) in sequence order.
at::Tensor in_sequence_order(const at::Tensor& rank_major, Layout layout, int64_t seq_dim) {
  const int64_t c = rank_major.size(0);
  const int64_t n = rank_major.size(seq_dim + 1) / (layout == Layout::Zigzag ? 2 : 1);
  std::vector<at::Tensor> chunks;
  for (auto [r, p] : owners(c, layout)) {
    chunks.push_back(rank_major[r].narrow(seq_dim, p * n, n));
  }
  return at::cat(chunks, seq_dim);
}

// Checks shared by the kernels and their fake kernels, so a trace raises what a run would.
Layout check_exchange(const at::Tensor& x, int64_t group_size, c10::string_view layout_name, bool to_sequence) {
  const char* op = to_sequence ? kToSequence : kToHeads;
  const Layout layout = parse_layout(layout_name, op);
  TORCH_CHECK(group_size >= 1, "torchpp.", op, ": group_size must be positive, got ", group_size);
  TORCH_CHECK(x.dim() >= 3, "torchpp.", op, ": expects [batch, heads, sequence, ...], got a tensor of ", x.dim(),
              " dims");
  if (to_sequence) {
    TORCH_CHECK(x.sym_size(1) % group_size == 0, "torchpp.", op, ": each rank keeps 1/c of the heads, but ",
                x.sym_size(1), " heads do not divide over c=", group_size, " ranks");
  } else {
    const int64_t chunks = group_size * (layout == Layout::Zigzag ? 2 : 1);
    TORCH_CHECK(x.sym_size(2) % chunks == 0, "torchpp.", op, ": the sequence of ", x.sym_size(2),
                " tokens does not divide into the ", chunks, " chunks of c=", group_size, " ranks (layout '",
                layout_name, "')");
  }
  return layout;
}

// [b, H, s_local, ...] -> [b, H / c, c * s_local, ...]: split the heads into c groups, send group j to rank j.
at::Tensor to_sequence(const at::Tensor& x, c10::string_view group_name, int64_t group_size,
                       c10::string_view layout_name) {
  const Layout layout = check_exchange(x, group_size, layout_name, true);
  auto group = cp_group(x, std::string(group_name), group_size, kToSequence);
  const int64_t c = group->getSize();
  auto sizes = x.sizes().vec();
  std::vector<int64_t> split{sizes[0], c, sizes[1] / c};
  split.insert(split.end(), sizes.begin() + 2, sizes.end());
  return in_sequence_order(exchange(*group, x.reshape(split).transpose(0, 1)), layout, 2);
}

// The inverse: [b, H / c, s, ...] -> [b, H, s_local, ...].
at::Tensor to_heads(const at::Tensor& y, c10::string_view group_name, int64_t group_size,
                    c10::string_view layout_name) {
  const Layout layout = check_exchange(y, group_size, layout_name, false);
  auto group = cp_group(y, std::string(group_name), group_size, kToHeads);
  const int64_t c = group->getSize();
  const int64_t n = y.size(2) / (layout == Layout::Zigzag ? 2 * c : c);
  std::vector<at::Tensor> shards;
  for (int64_t r = 0; r < c; ++r) {
    std::vector<at::Tensor> held;
    for (auto chunk : chunks_of(r, c, layout)) {
      held.push_back(y.narrow(2, chunk * n, n));
    }
    shards.push_back(held.size() == 1 ? held[0] : at::cat(held, 2));
  }
  auto received = exchange(*group, at::stack(shards));  // [c (head group), b, H / c, s_local, ...]
  auto sizes = received.sizes().vec();
  std::vector<int64_t> joined{sizes[1], sizes[0] * sizes[2]};
  joined.insert(joined.end(), sizes.begin() + 3, sizes.end());
  return received.transpose(0, 1).reshape(joined);
}

// ---- Fake kernels: shapes from the input alone; never touch a group ----

at::Tensor to_sequence_fake(const at::Tensor& x, c10::string_view, int64_t group_size, c10::string_view layout) {
  check_exchange(x, group_size, layout, true);
  auto sizes = x.sym_sizes().vec();
  sizes[1] = sizes[1] / group_size;
  sizes[2] = sizes[2] * group_size;
  return at::empty_symint(sizes, x.options());
}

at::Tensor to_heads_fake(const at::Tensor& y, c10::string_view, int64_t group_size, c10::string_view layout) {
  check_exchange(y, group_size, layout, false);
  auto sizes = y.sym_sizes().vec();
  sizes[1] = sizes[1] * group_size;
  sizes[2] = sizes[2] / group_size;
  return at::empty_symint(sizes, y.options());
}

// ---- Autograd: each direction's gradient is the other direction ----

using ExchangeOp = at::Tensor(const at::Tensor&, c10::string_view, int64_t, c10::string_view);

const c10::TypedOperatorHandle<ExchangeOp>& exchange_op(bool to_sequence) {
  static const auto sequence_op =
      c10::Dispatcher::singleton().findSchemaOrThrow("torchpp::heads_to_sequence", "").typed<ExchangeOp>();
  static const auto heads_op =
      c10::Dispatcher::singleton().findSchemaOrThrow("torchpp::sequence_to_heads", "").typed<ExchangeOp>();
  return to_sequence ? sequence_op : heads_op;
}

// Every rank of the group must join the backward's exchange, even one whose output got no gradient.
template <bool kForward>
struct HeadExchange : public torch::autograd::Function<HeadExchange<kForward>> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, c10::string_view group_name,
                            int64_t group_size, c10::string_view layout) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto y = exchange_op(kForward).call(x, group_name, group_size, layout);
    ctx->saved_data["group_name"] = std::string(group_name);
    ctx->saved_data["group_size"] = group_size;
    ctx->saved_data["layout"] = std::string(layout);
    ctx->saved_data["out_sizes"] = y.sym_sizes().vec();
    ctx->saved_data["dtype"] = y.scalar_type();
    ctx->saved_data["device"] = y.device();
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto& data = ctx->saved_data;
    auto grad = grads[0].defined()
                    ? grads[0]
                    : at::zeros_symint(data.at("out_sizes").toSymIntVector(),
                                       at::TensorOptions().dtype(data.at("dtype").toScalarType())
                                           .device(data.at("device").toDevice()));
    return {exchange_op(!kForward).call(grad, data.at("group_name").toStringRef(), data.at("group_size").toInt(),
                                        data.at("layout").toStringRef()),
            at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor to_sequence_autograd(const at::Tensor& x, c10::string_view group_name, int64_t group_size,
                                c10::string_view layout) {
  return HeadExchange<true>::apply(x, group_name, group_size, layout);
}

at::Tensor to_heads_autograd(const at::Tensor& y, c10::string_view group_name, int64_t group_size,
                             c10::string_view layout) {
  return HeadExchange<false>::apply(y, group_name, group_size, layout);
}

}  // namespace

at::Tensor heads_to_sequence(const at::Tensor& x, c10::string_view group_name, int64_t group_size,
                             c10::string_view layout) {
  return exchange_op(true).call(x, group_name, group_size, layout);
}

at::Tensor sequence_to_heads(const at::Tensor& y, c10::string_view group_name, int64_t group_size,
                             c10::string_view layout) {
  return exchange_op(false).call(y, group_name, group_size, layout);
}

at::Tensor segments_in_sequence_order(const at::Tensor& segment_ids, c10::string_view group_name,
                                      int64_t group_size, c10::string_view layout) {
  // (each rank sends every other rank a copy of its ids: one exchange, as if they were c heads)
  auto ids = segment_ids.to(at::kLong).unsqueeze(1).expand({segment_ids.size(0), group_size, segment_ids.size(1)});
  return heads_to_sequence(ids, group_name, group_size, layout).squeeze(1);
}

}  // namespace torchpp::cp

TORCH_LIBRARY_IMPL(torchpp, CompositeExplicitAutograd, m) {
  m.impl("heads_to_sequence", TORCH_FN(torchpp::cp::to_sequence));
  m.impl("sequence_to_heads", TORCH_FN(torchpp::cp::to_heads));
}

TORCH_LIBRARY_IMPL(torchpp, Autograd, m) {
  m.impl("heads_to_sequence", TORCH_FN(torchpp::cp::to_sequence_autograd));
  m.impl("sequence_to_heads", TORCH_FN(torchpp::cp::to_heads_autograd));
}

TORCH_LIBRARY_IMPL(torchpp, Meta, m) {
  m.impl("heads_to_sequence", TORCH_FN(torchpp::cp::to_sequence_fake));
  m.impl("sequence_to_heads", TORCH_FN(torchpp::cp::to_heads_fake));
}
