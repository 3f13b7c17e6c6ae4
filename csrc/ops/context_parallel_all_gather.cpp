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

// The gathered keys and values stay rank-major, as the all-gather leaves them: blocks read each
// key chunk where it lies and the gradients are summed into a rank-major buffer that is
// reduce-scattered as it is (no global-order copy of either: c shards' worth each).
struct Gathered {
  at::Tensor kv;        // [c, 2, b, hk, s_local, d], input dtype
  at::Tensor segments;  // [c, b, s_local] or undefined
};

Gathered gather(c10d::ProcessGroup& group, const at::Tensor& k, const at::Tensor& v,
                const std::optional<at::Tensor>& segment_ids) {
  RECORD_FUNCTION("torchpp::all_gather_attention::gather", std::vector<c10::IValue>());
  Gathered g;
  g.kv = all_gather_stacked(group, at::stack({k, v}));
  if (segment_ids.has_value() && segment_ids->defined()) {
    g.segments = all_gather_stacked(group, segment_ids->to(at::kLong));
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
            c10::string_view group_name, int64_t group_size, bool causal, std::optional<double> scale,
            c10::string_view layout_name, int64_t window,
    double softcap, const std::optional<at::Tensor>& alibi_slopes) {
  Setup s;
  s.layout = parse_layout(layout_name, kOp);
  s.shapes =
      check_inputs(q, k, v, segment_ids, scale, s.layout, group_size, causal, window, softcap, alibi_slopes, kOp);
  s.group = cp_group(q, std::string(group_name), group_size, kOp);
  s.mine = chunks_of(s.group->getRank(), group_size, s.layout);
  if (segment_ids.has_value() && segment_ids->defined()) {
    s.my_segments = segment_ids->to(at::kLong);
  }
  return s;
}

// One key chunk of the gathered sequence: held by `rank` as its piece `piece`, and what query
// piece i may see of it.
struct KeyChunk {
  int64_t rank, piece;
  BlockMask mask;

  at::Tensor of(const at::Tensor& rank_major, int64_t which, int64_t n) const {
    return rank_major[rank][which].narrow(2, piece * n, n);
  }
};

// The key chunks query piece i attends to, one block each: under causal attention those before
// the piece (no mask) and the diagonal one (the kernels' causal mask); every chunk otherwise;
// masked blocks where segment ids keep packed sequences apart or a sliding window cuts through.
std::vector<KeyChunk> key_chunks(const Setup& s, int64_t i, bool causal, const Gathered& g, c10::Device device) {
  const int64_t n = s.shapes.piece_len, c = g.kv.size(0), q_start = s.mine[i] * n;
  const auto q_segments = s.my_segments.defined() ? s.my_segments.narrow(1, i * n, n) : at::Tensor();
  std::vector<KeyChunk> chunks;
  for (int64_t r = 0; r < c; ++r) {
    const auto held = chunks_of(r, c, s.layout);
    for (int64_t p = 0; p < s.shapes.pieces; ++p) {
      const auto k_segments = g.segments.defined() ? g.segments[r].narrow(1, p * n, n) : at::Tensor();
      auto mask = block_mask(q_start, n, held[p] * n, n, causal, s.shapes.window, q_segments, k_segments, device);
      if (!mask.skip) chunks.push_back(KeyChunk{r, p, std::move(mask)});
    }
  }
  return chunks;
}

std::tuple<at::Tensor, at::Tensor> all_gather_attention_forward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& segment_ids,
    c10::string_view group_name, int64_t group_size, bool causal, std::optional<double> scale,
    c10::string_view layout_name, int64_t window,
    double softcap, const std::optional<at::Tensor>& alibi_slopes) {
  const Setup s = setup(q, k, v, segment_ids, group_name, group_size, causal, scale, layout_name, window, softcap,
                        alibi_slopes);
  const Gathered g = gather(*s.group, k, v, segment_ids);
  const int64_t n = s.shapes.piece_len;
  auto queries = split_queries(q, s.shapes, q.scalar_type());
  std::vector<at::Tensor> outs, lses;
  RECORD_FUNCTION("torchpp::all_gather_attention::block", std::vector<c10::IValue>());
  for (int64_t i = 0; i < s.shapes.pieces; ++i) {
    at::Tensor out, lse;
    for (const auto& chunk : key_chunks(s, i, causal, g, q.device())) {
      auto [block_out, block_lse] = block_forward(queries[i], chunk.of(g.kv, 0, n), chunk.of(g.kv, 1, n), chunk.mask,
                                                  s.shapes);
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
    int64_t group_size, bool causal, std::optional<double> scale, c10::string_view layout_name, int64_t window,
    double softcap, const std::optional<at::Tensor>& alibi_slopes) {
  const Setup s = setup(q, k, v, segment_ids, group_name, group_size, causal, scale, layout_name, window, softcap,
                        alibi_slopes);
  const Gathered g = gather(*s.group, k, v, segment_ids);
  const int64_t n = s.shapes.piece_len;
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
      for (const auto& chunk : key_chunks(s, i, causal, g, q.device())) {
        auto dk = chunk.of(kv_grads, 0, n);  // summed in place: a view of the rank-major buffer
        auto dv = chunk.of(kv_grads, 1, n);
        block_backward(queries[i], chunk.of(g.kv, 0, n), chunk.of(g.kv, 1, n), grads[i], outs[i], lses[i], chunk.mask,
                       s.shapes, dq, dk, dv);
      }
      dqs.push_back(dq.defined() ? dq : at::zeros(queries[i].sizes(), queries[i].options().dtype(s.shapes.acc_dtype)));
    }
  }
  // Every rank holds partial gradients of every shard: sum them at each shard's owner.
  auto flat = kv_grads.view({-1});
  auto own_flat = at::empty({flat.numel() / group_size}, kv_grads.options());
  {
    RECORD_FUNCTION("torchpp::all_gather_attention::reduce_scatter", std::vector<c10::IValue>());
    c10d_compat::reduce_scatter_single(*s.group, own_flat, flat)->wait();
  }
  auto own = own_flat.view(kv_grads.sizes().slice(1));
  return {join_queries(dqs, s.shapes, q.scalar_type()), own[0].to(k.scalar_type()).contiguous(),
          own[1].to(v.scalar_type()).contiguous()};  // (contiguous, as the fakes)
}

}  // namespace

TORCH_LIBRARY_IMPL(torchpp, CompositeExplicitAutograd, m) {
  m.impl("all_gather_attention_forward", TORCH_FN(all_gather_attention_forward));
  m.impl("all_gather_attention_backward", TORCH_FN(all_gather_attention_backward));
}

}  // namespace torchpp::cp
