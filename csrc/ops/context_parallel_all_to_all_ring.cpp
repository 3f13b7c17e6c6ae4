// Hierarchical context parallelism (Megatron's cp_comm_type "a2a+p2p"): all-to-all inside groups of
// a consecutive cp ranks (one node's, where the bandwidth is), the ring across the c' = c / a groups.
// An all-to-all trades this rank's shard of every head for its group's a shards of 1/a of the heads;
// those shards are exactly the shard the same layout gives ring rank o of c' (super-chunks of a
// chunks), so ring attention over the ring group runs on them unchanged, and a second all-to-all
// hands back this rank's shard of every head's output. Across groups a rank then passes c' - 1
// key/value blocks, not c - 1 (each a times longer, with 1/a of the heads); inside its group it
// sends the all-to-all's (a - 1) / a of q, k, v and the output, as all_to_all_attention does.
// Composed of differentiable pieces (the exchanges below, ring_attention's own autograd).
#include <numeric>
#include <optional>
#include <string>

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/library.h>

#include "ops/context_parallel.h"

namespace torchpp::cp {
namespace {

constexpr const char* kOp = "all_to_all_ring_attention";

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// One direction of the heads-for-sequence exchange over a group; its gradient takes the other.
// Every rank of the group must join the backward's exchange, even one whose output got no gradient.
template <bool kToSequence>
struct HeadExchange : public torch::autograd::Function<HeadExchange<kToSequence>> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const std::string& group_name,
                            int64_t group_size, const std::string& layout) {
    ctx->saved_data["group_name"] = group_name;
    ctx->saved_data["group_size"] = group_size;
    ctx->saved_data["layout"] = layout;
    auto y = run(x, group_name, group_size, layout, kToSequence);
    ctx->saved_data["out_sizes"] = y.sizes().vec();
    ctx->save_for_backward({at::empty({0}, y.options())});  // (the options of a missing gradient's zeros)
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto& data = ctx->saved_data;
    auto grad = grads[0].defined() ? grads[0]
                                   : at::zeros(data.at("out_sizes").toIntVector(),
                                               ctx->get_saved_variables()[0].options());
    return {run(grad, data.at("group_name").toStringRef(), data.at("group_size").toInt(),
                data.at("layout").toStringRef(), !kToSequence),
            at::Tensor(), at::Tensor(), at::Tensor()};
  }

  static at::Tensor run(const at::Tensor& x, const std::string& group_name, int64_t group_size,
                        const std::string& layout, bool to_sequence) {
    auto group = cp_group(x, group_name, group_size, kOp);
    const Layout parsed = parse_layout(layout, kOp);
    return to_sequence ? heads_to_sequence(*group, x, parsed) : sequence_to_heads(*group, x, parsed);
  }
};

using ToSequence = HeadExchange<true>;
using ToHeads = HeadExchange<false>;

using RingAttention = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                 const std::optional<at::Tensor>&, c10::string_view, int64_t, bool,
                                 std::optional<double>, c10::string_view, int64_t, const std::optional<at::Tensor>&,
                                 double, const std::optional<at::Tensor>&);

at::Tensor all_to_all_ring_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                     const std::optional<at::Tensor>& segment_ids,
                                     c10::string_view all_to_all_group_name, int64_t all_to_all_size,
                                     c10::string_view ring_group_name, int64_t ring_size, bool causal,
                                     std::optional<double> scale, c10::string_view layout_name, int64_t window,
                                     const std::optional<at::Tensor>& sinks, double softcap,
                                     const std::optional<at::Tensor>& alibi_slopes) {
  const Layout layout = parse_layout(layout_name, kOp);
  TORCH_CHECK(all_to_all_size >= 1 && ring_size >= 1, "torchpp.", kOp, ": group sizes must be positive, got ",
              "all_to_all_size=", all_to_all_size, " and ring_size=", ring_size);
  const Shapes shapes = check_inputs(q, k, v, segment_ids, scale, layout, all_to_all_size * ring_size, causal, window,
                                     softcap, alibi_slopes, kOp);
  TORCH_CHECK(shapes.q_heads % all_to_all_size == 0, "torchpp.", kOp, ": each rank of an all-to-all group attends "
              "with 1/a of the query heads, so its size must divide them, but ", shapes.q_heads,
              " query heads do not divide over a=", all_to_all_size, " ranks");
  if (has(sinks)) {
    check_sinks(q, *sinks, kOp);  // (before any exchange: a bad call raises on every rank alike)
  }
  const std::string inner_name(all_to_all_group_name), layout_str(layout_name);
  auto inner = cp_group(q, inner_name, all_to_all_size, kOp);
  cp_group(q, std::string(ring_group_name), ring_size, kOp);  // (checked before the first exchange)

  const int64_t local_heads = shapes.q_heads / all_to_all_size;
  const int64_t first_head = inner->getRank() * local_heads;
  // (a divides hq = hk * g; with r = a / gcd(hk, a), r divides g: each query head still reads one repeat)
  const int64_t repeats = all_to_all_size / std::gcd(shapes.kv_heads, all_to_all_size);
  auto to_sequence = [&](const at::Tensor& t) {
    return ToSequence::apply(t, inner_name, all_to_all_size, layout_str);
  };
  auto q_seq = to_sequence(q);
  auto k_seq = to_sequence(repeats > 1 ? k.repeat_interleave(repeats, 1) : k);
  auto v_seq = to_sequence(repeats > 1 ? v.repeat_interleave(repeats, 1) : v);
  std::optional<at::Tensor> segments, local_sinks, local_alibi;
  if (has(segment_ids)) {
    segments = in_sequence_order(all_gather_stacked(*inner, segment_ids->to(at::kLong)), layout, 1);
  }
  if (has(sinks)) {
    local_sinks = sinks->narrow(0, first_head, local_heads);  // (its gradient lands on these heads alone)
  }
  if (has(alibi_slopes)) {
    local_alibi = alibi_slopes->narrow(0, first_head, local_heads).contiguous();
  }
  static auto ring = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("torchpp::ring_attention", "")
                         .typed<RingAttention>();
  auto out = ring.call(q_seq, k_seq, v_seq, segments, ring_group_name, ring_size, causal, scale, layout_name, window,
                       local_sinks, softcap, local_alibi);
  return ToHeads::apply(out, inner_name, all_to_all_size, layout_str);
}

}  // namespace

// Composite: autograd comes from its pieces (the exchanges' and ring_attention's own).
TORCH_LIBRARY_IMPL(torchpp, CompositeImplicitAutograd, m) {
  m.impl("all_to_all_ring_attention", TORCH_FN(all_to_all_ring_attention));
}

}  // namespace torchpp::cp
