// All-to-all attention (DeepSpeed-Ulysses; Megatron's cp_comm_type "a2a"): one all-to-all trades
// each rank's sequence shard of every head for the whole sequence of 1/c of the heads; each rank
// attends with its heads over the whole sequence (one fused call where no mask of its own is
// needed), and a second all-to-all hands every rank its shard of each head's output. Forward moves
// q, k, v in and the output out; backward the output's gradient in and q's, k's and v's out: each
// a 1/c share of a tensor per rank, so a rank's traffic does not grow with c, where the ring sends
// c - 1 key/value shards. The heads must divide by c; key/value heads c does not divide are
// repeated first (each query head keeps its own). The exchanged tensors are saved for backward.
#include <numeric>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/library.h>

#include "ops/context_parallel.h"

namespace torchpp::cp {
namespace {

constexpr const char* kOp = "all_to_all_attention";

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// What forward and backward derive alike from a call.
struct Call {
  std::string group_name, layout_name;  // (the exchange ops take the group by name)
  int64_t group_size = 0;
  int64_t q_heads = 0, first_head = 0, local_heads = 0;  // this rank's heads: [first, first + local)
  int64_t kv_repeats = 1;  // key/value heads repeated so that c divides them
  int64_t chunk_len = 0;   // the caller's chunk of the sequence
};

Call make_call(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
               const std::optional<at::Tensor>& segment_ids, c10::string_view group_name, int64_t group_size,
               bool causal, std::optional<double> scale, c10::string_view layout_name, int64_t window,
               double softcap, const std::optional<at::Tensor>& alibi_slopes) {
  Call call;
  const Shapes shapes = check_inputs(q, k, v, segment_ids, scale, parse_layout(layout_name, kOp), group_size, causal,
                                     window, softcap, alibi_slopes, kOp);
  TORCH_CHECK(shapes.q_heads % group_size == 0, "torchpp.", kOp, ": each rank attends with 1/c of the query heads "
              "over the whole sequence, so the group size must divide them, but ", shapes.q_heads,
              " query heads do not divide over ", group_size, " ranks; use mode 'ring' or 'all-gather'");
  call.group_name = std::string(group_name);
  call.layout_name = std::string(layout_name);
  call.group_size = group_size;
  call.q_heads = shapes.q_heads;
  call.local_heads = shapes.q_heads / group_size;
  call.first_head = cp_group(q, call.group_name, group_size, kOp)->getRank() * call.local_heads;
  // (c divides hq = hk * g; with r = c / gcd(hk, c), r divides g: each query head still reads one repeat)
  call.kv_repeats = group_size / std::gcd(shapes.kv_heads, group_size);
  call.chunk_len = shapes.piece_len;
  return call;
}

// This rank's heads over the whole sequence, and how its attention is cut into blocks: chunks of
// the caller's length where blocks need masks of their own (packed rows) or take the matmul path
// (capped or biased scores), so no [s, s] scores are held; else one block, run whole by a fused
// kernel (causal or windowed by its own masking).
struct Exchanged {
  at::Tensor q, k, v, segments;  // [b, H / c, s, d]; segments [b, s] or undefined
  at::Tensor sinks, alibi;       // this rank's heads' [H / c], or undefined
  Shapes shapes;
};

Shapes local_shapes(const Exchanged& x, std::optional<double> scale, bool causal, int64_t window, double softcap,
                    int64_t chunk_len) {
  const auto segments = x.segments.defined() ? std::optional<at::Tensor>(x.segments) : std::nullopt;
  const auto alibi = x.alibi.defined() ? std::optional<at::Tensor>(x.alibi) : std::nullopt;
  Shapes shapes = check_inputs(x.q, x.k, x.v, segments, scale, Layout::Contiguous, 1, causal, window, softcap, alibi,
                               kOp);
  if (x.segments.defined() || softcap > 0 || x.alibi.defined()) {
    shapes.piece_len = chunk_len;
    shapes.pieces = shapes.s_local / chunk_len;
  }
  return shapes;
}

Exchanged exchange_inputs(const Call& call, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const std::optional<at::Tensor>& segment_ids, const std::optional<at::Tensor>& sinks,
                          const std::optional<at::Tensor>& alibi_slopes) {
  if (has(sinks)) {
    check_sinks(q, *sinks, kOp);  // (before any exchange: a bad call raises on every rank alike)
  }
  auto to_sequence = [&](const at::Tensor& t) {
    return heads_to_sequence(t, call.group_name, call.group_size, call.layout_name);
  };
  Exchanged x;
  x.q = to_sequence(q);
  x.k = to_sequence(call.kv_repeats > 1 ? k.repeat_interleave(call.kv_repeats, 1) : k);
  x.v = to_sequence(call.kv_repeats > 1 ? v.repeat_interleave(call.kv_repeats, 1) : v);
  if (has(segment_ids)) {
    x.segments = segments_in_sequence_order(*segment_ids, call.group_name, call.group_size, call.layout_name);
  }
  if (has(sinks)) {
    x.sinks = sinks->narrow(0, call.first_head, call.local_heads);
  }
  if (has(alibi_slopes)) {
    x.alibi = alibi_slopes->narrow(0, call.first_head, call.local_heads).contiguous();
  }
  return x;
}

// The call checked, its inputs exchanged and its blocks cut: what the attention then runs on.
std::pair<Call, Exchanged> prepare(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   const std::optional<at::Tensor>& segment_ids, c10::string_view group_name,
                                   int64_t group_size, bool causal, std::optional<double> scale,
                                   c10::string_view layout, int64_t window, const std::optional<at::Tensor>& sinks,
                                   double softcap, const std::optional<at::Tensor>& alibi_slopes) {
  Call call = make_call(q, k, v, segment_ids, group_name, group_size, causal, scale, layout, window, softcap,
                        alibi_slopes);
  Exchanged x = exchange_inputs(call, q, k, v, segment_ids, sinks, alibi_slopes);
  x.shapes = local_shapes(x, scale, causal, window, softcap, call.chunk_len);
  return {std::move(call), std::move(x)};
}

// The block of query chunk i against key chunk j, by position in the whole sequence.
BlockMask chunk_mask(const Exchanged& x, int64_t i, int64_t j, bool causal) {
  const int64_t n = x.shapes.piece_len;
  const auto q_segments = x.segments.defined() ? x.segments.narrow(1, i * n, n) : at::Tensor();
  const auto k_segments = x.segments.defined() ? x.segments.narrow(1, j * n, n) : at::Tensor();
  return block_mask(i * n, n, j * n, n, causal, x.shapes.window, q_segments, k_segments, x.q.device());
}

std::pair<at::Tensor, at::Tensor> attend(const Exchanged& x, bool causal) {
  RECORD_FUNCTION("torchpp::all_to_all_attention::block", std::vector<c10::IValue>());
  const auto& shapes = x.shapes;
  const int64_t n = shapes.piece_len;
  auto queries = split_queries(x.q, shapes, x.q.scalar_type());
  std::vector<at::Tensor> outs, lses;
  for (int64_t i = 0; i < shapes.pieces; ++i) {
    at::Tensor out, lse;
    for (int64_t j = 0; j < shapes.pieces; ++j) {
      const auto mask = chunk_mask(x, i, j, causal);
      if (mask.skip) continue;
      auto [block_out, block_lse] = block_forward(queries[i], x.k.narrow(2, j * n, n), x.v.narrow(2, j * n, n), mask,
                                                  shapes);
      merge_block(out, lse, std::move(block_out), block_lse);
    }
    fill_unreached(out, lse, queries[i], shapes.acc_dtype);
    outs.push_back(out);
    lses.push_back(lse);
  }
  auto out = join_queries(outs, shapes, x.q.scalar_type());
  auto lse = join_queries(lses, shapes, shapes.acc_dtype);
  return x.sinks.defined() ? fold_sinks(out, lse, x.sinks) : std::make_pair(out, lse);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attend_backward(const Exchanged& x, const at::Tensor& grad_out,
                                                               const at::Tensor& out, const at::Tensor& lse,
                                                               bool causal) {
  RECORD_FUNCTION("torchpp::all_to_all_attention::block_backward", std::vector<c10::IValue>());
  const auto& shapes = x.shapes;
  const int64_t n = shapes.piece_len;
  auto queries = split_queries(x.q, shapes, x.q.scalar_type());
  auto grads = split_queries(grad_out, shapes, x.q.scalar_type());
  auto lses = split_queries(lse, shapes, shapes.acc_dtype);
  auto outs = split_queries(out, shapes, x.q.scalar_type());
  auto dk_all = at::zeros(x.k.sizes(), x.k.options().dtype(shapes.acc_dtype));
  auto dv_all = at::zeros(x.v.sizes(), x.v.options().dtype(shapes.acc_dtype));
  std::vector<at::Tensor> dqs;
  for (int64_t i = 0; i < shapes.pieces; ++i) {
    at::Tensor dq;  // set by the chunk's first block
    for (int64_t j = 0; j < shapes.pieces; ++j) {
      const auto mask = chunk_mask(x, i, j, causal);
      if (mask.skip) continue;
      auto dk = dk_all.narrow(2, j * n, n);  // summed in place
      auto dv = dv_all.narrow(2, j * n, n);
      block_backward(queries[i], x.k.narrow(2, j * n, n), x.v.narrow(2, j * n, n), grads[i], outs[i], lses[i], mask,
                     shapes, dq, dk, dv);
    }
    dqs.push_back(dq.defined() ? dq : at::zeros(queries[i].sizes(), queries[i].options().dtype(shapes.acc_dtype)));
  }
  return {join_queries(dqs, shapes, x.q.scalar_type()), dk_all.to(x.k.scalar_type()), dv_all.to(x.v.scalar_type())};
}

// A key/value gradient of the repeated heads [b, hk * r, s_local, d] summed back onto [b, hk, s_local, d].
at::Tensor unrepeated(const at::Tensor& grad, int64_t repeats) {
  if (repeats == 1) return grad;
  auto sizes = grad.sizes().vec();
  std::vector<int64_t> split{sizes[0], sizes[1] / repeats, repeats};
  split.insert(split.end(), sizes.begin() + 2, sizes.end());
  return grad.reshape(split).sum(2);
}

struct AllToAllAttention : public torch::autograd::Function<AllToAllAttention> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const std::optional<at::Tensor>& segment_ids, c10::string_view group_name,
                            int64_t group_size, bool causal, std::optional<double> scale, c10::string_view layout,
                            int64_t window, const std::optional<at::Tensor>& sinks, double softcap,
                            const std::optional<at::Tensor>& alibi_slopes) {
    // (no dispatch-below-autograd guard: apply() has turned grad mode off, and the aten ops within keep
    // their composite handling, so none hands back its input as a new op's output, which opcheck refuses)
    const auto [call, x] = prepare(q, k, v, segment_ids, group_name, group_size, causal, scale, layout, window, sinks,
                                   softcap, alibi_slopes);
    auto [out, lse] = attend(x, causal);
    ctx->save_for_backward({x.q, x.k, x.v, out, lse, x.segments, x.sinks, x.alibi});
    save_options(ctx->saved_data, group_name, group_size, causal, scale, layout, window, softcap);
    ctx->saved_data["q_heads"] = call.q_heads;
    ctx->saved_data["first_head"] = call.first_head;
    ctx->saved_data["kv_repeats"] = call.kv_repeats;
    ctx->saved_data["chunk_len"] = call.chunk_len;
    return sequence_to_heads(out, call.group_name, call.group_size, call.layout_name);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const auto& data = ctx->saved_data;
    const auto& group_name = data.at("group_name").toStringRef();
    const auto& layout = data.at("layout").toStringRef();
    const int64_t c = data.at("group_size").toInt();
    const bool causal = data.at("causal").toBool();
    const std::optional<double> scale = saved_scale(data);
    Exchanged x{saved[0], saved[1], saved[2], saved[5], saved[6], saved[7], Shapes{}};
    x.shapes = local_shapes(x, scale, causal, data.at("window").toInt(), data.at("softcap").toDouble(),
                            data.at("chunk_len").toInt());
    // Every rank of the group must take part in the exchange, even one whose output got no gradient.
    const auto& out = saved[3];
    auto given = grads[0].defined() ? grads[0]
                                    : at::zeros({out.size(0), out.size(1) * c, out.size(2) / c, out.size(3)},
                                                out.options());
    auto grad_out = heads_to_sequence(given, group_name, c, layout);
    auto [dq, dk, dv] = attend_backward(x, grad_out, out, saved[4], causal);
    at::Tensor dsinks;
    if (x.sinks.defined()) {
      dsinks = at::zeros({data.at("q_heads").toInt()}, x.sinks.options());
      dsinks.narrow(0, data.at("first_head").toInt(), x.sinks.size(0)).copy_(sinks_grad(grad_out, out, saved[4],
                                                                                           x.sinks));
    }
    const int64_t repeats = data.at("kv_repeats").toInt();
    auto to_heads = [&](const at::Tensor& t) { return sequence_to_heads(t, group_name, c, layout); };
    return {to_heads(dq), unrepeated(to_heads(dk), repeats), unrepeated(to_heads(dv), repeats),
            at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), dsinks,
            at::Tensor(), at::Tensor()};
  }
};

at::Tensor all_to_all_attention_autograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                         const std::optional<at::Tensor>& segment_ids, c10::string_view group_name,
                                         int64_t group_size, bool causal, std::optional<double> scale,
                                         c10::string_view layout, int64_t window,
                                         const std::optional<at::Tensor>& sinks, double softcap,
                                         const std::optional<at::Tensor>& alibi_slopes) {
  return AllToAllAttention::apply(q, k, v, segment_ids, group_name, group_size, causal, scale, layout, window, sinks,
                                  softcap, alibi_slopes);
}

// Without autograd (no_grad, inference): the output alone.
at::Tensor all_to_all_attention_no_grad(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                        const std::optional<at::Tensor>& segment_ids, c10::string_view group_name,
                                        int64_t group_size, bool causal, std::optional<double> scale,
                                        c10::string_view layout, int64_t window,
                                        const std::optional<at::Tensor>& sinks, double softcap,
                                        const std::optional<at::Tensor>& alibi_slopes) {
  const auto [call, x] = prepare(q, k, v, segment_ids, group_name, group_size, causal, scale, layout, window, sinks,
                                 softcap, alibi_slopes);
  return sequence_to_heads(attend(x, causal).first, call.group_name, call.group_size, call.layout_name);
}

at::Tensor all_to_all_attention_fake(const at::Tensor& q, const at::Tensor&, const at::Tensor&,
                                     const std::optional<at::Tensor>&, c10::string_view, int64_t, bool,
                                     std::optional<double>, c10::string_view, int64_t,
                                     const std::optional<at::Tensor>&, double, const std::optional<at::Tensor>&) {
  return at::empty_symint(q.sym_sizes(), q.options());  // (contiguous, as sequence_to_heads returns it)
}

}  // namespace

TORCH_LIBRARY_IMPL(torchpp, Autograd, m) {
  m.impl("all_to_all_attention", TORCH_FN(all_to_all_attention_autograd));
}

TORCH_LIBRARY_IMPL(torchpp, CompositeExplicitAutograd, m) {
  m.impl("all_to_all_attention", TORCH_FN(all_to_all_attention_no_grad));
}

TORCH_LIBRARY_IMPL(torchpp, Meta, m) {
  m.impl("all_to_all_attention", TORCH_FN(all_to_all_attention_fake));
}

}  // namespace torchpp::cp
