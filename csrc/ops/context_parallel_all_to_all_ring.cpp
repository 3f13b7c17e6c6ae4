// Hierarchical context parallelism (Megatron's cp_comm_type "a2a+p2p"): all-to-all inside groups of
// a consecutive cp ranks (one node's, where the bandwidth is), the ring across the c' = c / a groups.
// An all-to-all trades this rank's shard of every head for its group's a shards of 1/a of the heads;
// those shards are exactly the shard the same layout gives ring rank o of c' (super-chunks of a
// chunks), so ring attention over the ring group runs on them unchanged, and a second all-to-all
// hands back this rank's shard of every head's output. Across groups a rank then passes c' - 1
// key/value blocks, not c - 1 (each a times longer, with 1/a of the heads); inside its group it
// sends the all-to-all's (a - 1) / a of q, k, v and the output, as all_to_all_attention does.
// Composed of differentiable ops (heads_to_sequence / sequence_to_heads, ring_attention), each one node
// in a trace.
#include <numeric>
#include <optional>
#include <string>

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/library.h>

#include "ops/context_parallel.h"

namespace torchpp::cp {
namespace {

constexpr const char* kOp = "all_to_all_ring_attention";

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
  TORCH_CHECK(all_to_all_size >= 1 && ring_size >= 1, "torchpp.", kOp, ": group sizes must be positive, got ",
              "all_to_all_size=", all_to_all_size, " and ring_size=", ring_size);
  const Shapes shapes = check_inputs(q, k, v, segment_ids, scale, parse_layout(layout_name, kOp),
                                     all_to_all_size * ring_size, causal, window, softcap, alibi_slopes, kOp);
  TORCH_CHECK(shapes.q_heads % all_to_all_size == 0, "torchpp.", kOp, ": each rank of an all-to-all group attends "
              "with 1/a of the query heads, so its size must divide them, but ", shapes.q_heads,
              " query heads do not divide over a=", all_to_all_size, " ranks");
  if (has(sinks)) {
    check_sinks(q, *sinks, kOp);  // (before any exchange: a bad call raises on every rank alike)
  }
  auto inner = cp_group(q, std::string(all_to_all_group_name), all_to_all_size, kOp);
  cp_group(q, std::string(ring_group_name), ring_size, kOp);  // (checked before the first exchange)

  const int64_t local_heads = shapes.q_heads / all_to_all_size;
  const int64_t first_head = inner->getRank() * local_heads;
  // (a divides hq = hk * g; with r = a / gcd(hk, a), r divides g: each query head still reads one repeat)
  const int64_t repeats = all_to_all_size / std::gcd(shapes.kv_heads, all_to_all_size);
  auto to_sequence = [&](const at::Tensor& t) {  // (differentiable: the op's gradient is the inverse exchange)
    return heads_to_sequence(t, all_to_all_group_name, all_to_all_size, layout_name);
  };
  auto q_seq = to_sequence(q);
  auto k_seq = to_sequence(repeats > 1 ? k.repeat_interleave(repeats, 1) : k);
  auto v_seq = to_sequence(repeats > 1 ? v.repeat_interleave(repeats, 1) : v);
  std::optional<at::Tensor> segments, local_sinks, local_alibi;
  if (has(segment_ids)) {
    segments = segments_in_sequence_order(*segment_ids, all_to_all_group_name, all_to_all_size, layout_name);
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
  return sequence_to_heads(out, all_to_all_group_name, all_to_all_size, layout_name);
}

}  // namespace

// Composite: autograd comes from its pieces (the exchanges' and ring_attention's own).
TORCH_LIBRARY_IMPL(torchpp, CompositeImplicitAutograd, m) {
  m.impl("all_to_all_ring_attention", TORCH_FN(all_to_all_ring_attention));
}

}  // namespace torchpp::cp
