// All-gather attention: every rank gathers the whole sequence's keys and values once and
// attends its queries to the keys before them (causal) or to all; the backward gathers them
// again (rather than keeping c times the key/value memory) and reduce-scatters their gradients.
#include <limits>
#include <tuple>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/library.h>

#include "ops/c10d_compat.h"
#include "ops/context_parallel.h"

namespace torchpp::cp {
namespace {

constexpr const char* kOp = "all_gather_attention";

// Rank-major shards [c, ..., s_local, ...] (sequence at `dim` of each shard) -> the sequence in
// global order along `dim`.
at::Tensor to_global(const at::Tensor& stacked, int64_t dim, Layout layout, const Shapes& shapes) {
  const int64_t c = stacked.size(0), n = shapes.piece_len;
  std::vector<at::Tensor> chunks(c * shapes.pieces);
  for (int64_t r = 0; r < c; ++r) {
    const auto held = chunks_of(r, c, layout);
    for (int64_t p = 0; p < shapes.pieces; ++p) {
      chunks[held[p]] = stacked[r].narrow(dim, p * n, n);
    }
  }
  return at::cat(chunks, dim);
}

// The inverse of to_global: [..., S, ...] -> [c, ..., s_local, ...].
at::Tensor to_rank_major(const at::Tensor& global, int64_t dim, int64_t c, Layout layout, const Shapes& shapes) {
  const int64_t n = shapes.piece_len;
  std::vector<at::Tensor> shards;
  for (int64_t r = 0; r < c; ++r) {
    std::vector<at::Tensor> pieces;
    for (int64_t chunk : chunks_of(r, c, layout)) {
      pieces.push_back(global.narrow(dim, chunk * n, n));
    }
    shards.push_back(at::cat(pieces, dim));
  }
  return at::stack(shards);
}

struct Gathered {
  at::Tensor kv;        // [2, b, hk, S, d], input dtype
  at::Tensor segments;  // [b, S] or undefined
};

Gathered gather(c10d::ProcessGroup& group, const at::Tensor& k, const at::Tensor& v,
                const std::optional<at::Tensor>& segment_ids, Layout layout, const Shapes& shapes) {
  RECORD_FUNCTION("torchpp::all_gather_attention::gather", std::vector<c10::IValue>());
  Gathered g;
  g.kv = to_global(all_gather_stacked(group, at::stack({k, v})), 3, layout, shapes);
  if (segment_ids.has_value() && segment_ids->defined()) {
    g.segments = to_global(all_gather_stacked(group, segment_ids->to(at::kLong)), 1, layout, shapes);
  }
  return g;
}

struct Setup {
  Layout layout;
  Shapes shapes;
  c10::intrusive_ptr<c10d::ProcessGroup> group;
  std::vector<int64_t> mine;
  at::Tensor my_segments;  // [b, s_local] or undefined
};

Setup setup(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& segment_ids,
            c10::string_view group_name, int64_t group_size, std::optional<double> scale, c10::string_view layout_name) {
  Setup s;
  s.layout = parse_layout(layout_name, kOp);
  s.shapes = check_inputs(q, k, v, segment_ids, scale, s.layout, group_size, kOp);
  s.group = cp_group(q, std::string(group_name), group_size, kOp);
  s.mine = chunks_of(s.group->getRank(), group_size, s.layout);
  if (segment_ids.has_value() && segment_ids->defined()) {
    s.my_segments = segment_ids->to(at::kLong);
  }
  return s;
}

// Keys [start, start + len) of the gathered sequence and what query piece i may see of them.
struct KeySpan {
  int64_t start, len;
  BlockMask mask;
};

// The key blocks of query piece i: all keys (full attention); under causal attention the keys
// before the piece (no mask) and the square diagonal block (the kernels' causal mask), or one
// masked block when segment ids keep packed sequences apart.
std::vector<KeySpan> key_spans(const Setup& s, int64_t i, int64_t seq_len, bool causal, const Gathered& g,
                               c10::Device device) {
  const int64_t n = s.shapes.piece_len, q_start = s.mine[i] * n;
  const bool packed = s.my_segments.defined();
  const auto q_segments = packed ? s.my_segments.narrow(1, i * n, n) : at::Tensor();
  auto span = [&](int64_t start, int64_t len) {
    const auto k_segments = packed ? g.segments.narrow(1, start, len) : at::Tensor();
    return KeySpan{start, len, block_mask(q_start, n, start, len, causal, q_segments, k_segments, device)};
  };
  if (!causal) {
    return {span(0, seq_len)};
  }
  if (packed) {
    return {span(0, q_start + n)};
  }
  std::vector<KeySpan> spans;
  if (q_start > 0) {
    spans.push_back(span(0, q_start));
  }
  spans.push_back(span(q_start, n));
  return spans;
}

std::tuple<at::Tensor, at::Tensor> all_gather_attention_forward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& segment_ids,
    c10::string_view group_name, int64_t group_size, bool causal, std::optional<double> scale,
    c10::string_view layout_name) {
  const Setup s = setup(q, k, v, segment_ids, group_name, group_size, scale, layout_name);
  const Gathered g = gather(*s.group, k, v, segment_ids, s.layout, s.shapes);
  const int64_t seq_len = g.kv.size(3);
  auto queries = split_queries(q, s.shapes, q.scalar_type());
  std::vector<at::Tensor> outs, lses;
  RECORD_FUNCTION("torchpp::all_gather_attention::block", std::vector<c10::IValue>());
  for (int64_t i = 0; i < s.shapes.pieces; ++i) {
    at::Tensor out, lse;
    for (const auto& span : key_spans(s, i, seq_len, causal, g, q.device())) {
      auto [block_out, block_lse] = block_forward(queries[i], g.kv[0].narrow(2, span.start, span.len),
                                                  g.kv[1].narrow(2, span.start, span.len), span.mask, s.shapes);
      merge_block(out, lse, std::move(block_out), block_lse);
    }
    fill_unreached(out, lse, queries[i], s.shapes.acc_dtype);
    outs.push_back(out);
    lses.push_back(lse);
  }
  return {join_queries(outs, s.shapes, q.scalar_type()), join_queries(lses, s.shapes, s.shapes.acc_dtype)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> all_gather_attention_backward(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const std::optional<at::Tensor>& segment_ids, c10::string_view group_name,
    int64_t group_size, bool causal, std::optional<double> scale, c10::string_view layout_name) {
  const Setup s = setup(q, k, v, segment_ids, group_name, group_size, scale, layout_name);
  const Gathered g = gather(*s.group, k, v, segment_ids, s.layout, s.shapes);
  const int64_t seq_len = g.kv.size(3);
  auto queries = split_queries(q, s.shapes, q.scalar_type());
  auto grads = split_queries(grad_out, s.shapes, q.scalar_type());
  auto lses = split_queries(lse, s.shapes, s.shapes.acc_dtype);
  auto outs = split_queries(out, s.shapes, q.scalar_type());
  auto kv_grads = at::zeros(g.kv.sizes(), g.kv.options().dtype(s.shapes.acc_dtype));
  std::vector<at::Tensor> dqs;
  {
    RECORD_FUNCTION("torchpp::all_gather_attention::block_backward", std::vector<c10::IValue>());
    for (int64_t i = 0; i < s.shapes.pieces; ++i) {
      at::Tensor dq;  // set by the piece's first block
      for (const auto& span : key_spans(s, i, seq_len, causal, g, q.device())) {
        auto dk = kv_grads[0].narrow(2, span.start, span.len);
        auto dv = kv_grads[1].narrow(2, span.start, span.len);
        block_backward(queries[i], g.kv[0].narrow(2, span.start, span.len), g.kv[1].narrow(2, span.start, span.len),
                       grads[i], outs[i], lses[i], span.mask, s.shapes, dq, dk, dv);
      }
      dqs.push_back(dq.defined() ? dq : at::zeros(queries[i].sizes(), queries[i].options().dtype(s.shapes.acc_dtype)));
    }
  }
  // Every rank holds partial gradients of every shard: sum them at each shard's owner.
  auto stacked = to_rank_major(kv_grads, 3, group_size, s.layout, s.shapes).contiguous();
  auto flat = stacked.view({-1});
  auto own_flat = at::empty({flat.numel() / group_size}, stacked.options());
  {
    RECORD_FUNCTION("torchpp::all_gather_attention::reduce_scatter", std::vector<c10::IValue>());
    c10d_compat::reduce_scatter_single(*s.group, own_flat, flat)->wait();
  }
  auto own = own_flat.view(stacked.sizes().slice(1));
  return {join_queries(dqs, s.shapes, q.scalar_type()), own[0].to(k.scalar_type()), own[1].to(v.scalar_type())};
}

}  // namespace

TORCH_LIBRARY_IMPL(torchpp, CompositeExplicitAutograd, m) {
  m.impl("all_gather_attention_forward", TORCH_FN(all_gather_attention_forward));
  m.impl("all_gather_attention_backward", TORCH_FN(all_gather_attention_backward));
}

}  // namespace torchpp::cp
