// Shared pieces of context-parallel attention: layouts, input checks, block masks, the matmul
// path's block math (forward with log-sum-exp, flash-style backward), the log-sum-exp merge and
// the ring's paired send/receive.
#include "ops/context_parallel.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "ops/c10d_compat.h"
#include "ops/process_group.h"

namespace torchpp::cp {

Layout parse_layout(c10::string_view layout, const char* op_name) {
  if (layout == "zigzag") {
    return Layout::Zigzag;
  }
  if (layout == "contiguous") {
    return Layout::Contiguous;
  }
  TORCH_CHECK(false, "torchpp.", op_name, ": layout must be 'zigzag' or 'contiguous', got '", layout, "'");
}

std::vector<int64_t> chunks_of(int64_t rank, int64_t world, Layout layout) {
  if (layout == Layout::Contiguous) {
    return {rank};
  }
  return {rank, 2 * world - 1 - rank};
}

Shapes check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const std::optional<at::Tensor>& segment_ids, std::optional<double> scale,
                    Layout layout, int64_t group_size, bool causal, int64_t window, double softcap,
                    const std::optional<at::Tensor>& alibi_slopes, const char* op_name) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "torchpp.", op_name,
              ": query, key and value must be [batch, heads, s_local, head_dim], got shapes ", q.sizes(), ", ",
              k.sizes(), ", ", v.sizes());
  TORCH_CHECK(k.sizes() == v.sizes(), "torchpp.", op_name, ": key ", k.sizes(), " and value ", v.sizes(),
              " must have the same shape");
  TORCH_CHECK(q.size(0) == k.size(0) && q.size(2) == k.size(2) && q.size(3) == k.size(3), "torchpp.", op_name,
              ": query ", q.sizes(), " and key ", k.sizes(),
              " must agree in batch, sequence shard length and head_dim");
  TORCH_CHECK(k.size(1) > 0 && q.size(1) % k.size(1) == 0, "torchpp.", op_name, ": query heads ", q.size(1),
              " must be a multiple of key/value heads ", k.size(1));
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type() &&
                  at::isFloatingType(q.scalar_type()),
              "torchpp.", op_name, ": query, key and value must share one floating dtype, got ", q.scalar_type(), ", ",
              k.scalar_type(), ", ", v.scalar_type());
  TORCH_CHECK(q.device() == k.device() && q.device() == v.device(), "torchpp.", op_name,
              ": query, key and value must be on one device");
  TORCH_CHECK(group_size > 0, "torchpp.", op_name, ": group_size must be positive, got ", group_size);
  TORCH_CHECK(window >= 0, "torchpp.", op_name, ": window must be positive (0: none), got ", window);
  Shapes shapes;
  shapes.batch = q.size(0);
  shapes.q_heads = q.size(1);
  shapes.kv_heads = k.size(1);
  shapes.groups = q.size(1) / k.size(1);
  shapes.s_local = q.size(2);
  shapes.head_dim = q.size(3);
  TORCH_CHECK(shapes.s_local > 0, "torchpp.", op_name, ": the sequence shard is empty");
  shapes.pieces = layout == Layout::Zigzag ? 2 : 1;
  TORCH_CHECK(shapes.s_local % shapes.pieces == 0, "torchpp.", op_name,
              ": the zigzag layout cuts the sequence into 2c = ", 2 * group_size,
              " chunks, so this rank's shard must hold two equal chunks, but it has ", shapes.s_local,
              " tokens (a sequence of ", shapes.s_local * group_size, " tokens is not divisible by ",
              2 * group_size, ")");
  shapes.piece_len = shapes.s_local / shapes.pieces;
  if (segment_ids.has_value() && segment_ids->defined()) {
    const auto& seg = *segment_ids;
    TORCH_CHECK(seg.dim() == 2 && seg.size(0) == shapes.batch && seg.size(1) == shapes.s_local, "torchpp.",
                op_name, ": segment_ids must be [batch, s_local] = [", shapes.batch, ", ", shapes.s_local, "], got ",
                seg.sizes());
    TORCH_CHECK(!at::isFloatingType(seg.scalar_type()) && seg.scalar_type() != at::kBool, "torchpp.", op_name,
                ": segment_ids must be integers, got ", seg.scalar_type());
  }
  shapes.window = window;
  TORCH_CHECK(softcap >= 0 && std::isfinite(softcap), "torchpp.", op_name,
              ": softcap must be positive and finite (0: none), got ", softcap);
  shapes.softcap = softcap;
  if (alibi_slopes.has_value() && alibi_slopes->defined()) {
    const auto& slopes = *alibi_slopes;
    TORCH_CHECK(slopes.dim() == 1 && slopes.size(0) == shapes.q_heads && at::isFloatingType(slopes.scalar_type()) &&
                    slopes.device() == q.device(),
                "torchpp.", op_name, ": alibi_slopes must hold one floating slope per query head on the query's "
                "device, [", shapes.q_heads, "], got ", slopes.sizes(), " ", slopes.scalar_type(), " on ",
                slopes.device());
  }
  shapes.scale = scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(shapes.head_dim));
  const auto dtype = q.scalar_type();
  shapes.acc_dtype = (dtype == at::kHalf || dtype == at::kBFloat16) ? at::kFloat : dtype;
  if (alibi_slopes.has_value() && alibi_slopes->defined()) {
    shapes.alibi = alibi_slopes->to(shapes.acc_dtype).view({1, shapes.kv_heads, shapes.groups, 1, 1});
  }
  return shapes;
}

std::vector<at::Tensor> split_queries(const at::Tensor& t, const Shapes& shapes, at::ScalarType dtype) {
  auto rest = t.sizes().slice(3).vec();  // head_dim, or nothing for the log-sum-exp
  std::vector<int64_t> grouped{shapes.batch, shapes.kv_heads, shapes.groups, shapes.s_local};
  grouped.insert(grouped.end(), rest.begin(), rest.end());
  auto view = t.reshape(grouped);
  std::vector<int64_t> folded{shapes.batch, shapes.kv_heads, shapes.groups * shapes.piece_len};
  folded.insert(folded.end(), rest.begin(), rest.end());
  std::vector<at::Tensor> pieces;
  for (int64_t p = 0; p < shapes.pieces; ++p) {
    pieces.push_back(
        // A view where the heads need no regrouping (the kernels take strided rows): no copy of q, out, dout.
        view.narrow(3, p * shapes.piece_len, shapes.piece_len).to(dtype).reshape(folded));
  }
  return pieces;
}

at::Tensor join_queries(const std::vector<at::Tensor>& pieces, const Shapes& shapes, at::ScalarType dtype) {
  std::vector<at::Tensor> grouped;
  for (const auto& piece : pieces) {
    auto rest = piece.sizes().slice(3).vec();
    std::vector<int64_t> shape{shapes.batch, shapes.kv_heads, shapes.groups, shapes.piece_len};
    shape.insert(shape.end(), rest.begin(), rest.end());
    grouped.push_back(piece.reshape(shape).to(dtype));  // pieces may differ: one block's, or widened
  }
  auto joined = grouped.size() == 1 ? grouped[0] : at::cat(grouped, 3);
  auto rest = joined.sizes().slice(4).vec();
  std::vector<int64_t> shape{shapes.batch, shapes.q_heads, shapes.s_local};
  shape.insert(shape.end(), rest.begin(), rest.end());
  return joined.reshape(shape).contiguous();
}

BlockMask block_mask(int64_t q_start, int64_t sq, int64_t k_start, int64_t sk, bool causal, int64_t window,
                     const at::Tensor& q_segments, const at::Tensor& k_segments, c10::Device device) {
  BlockMask mask;
  mask.q_start = q_start;
  mask.k_start = k_start;
  const int64_t q_last = q_start + sq - 1, k_last = k_start + sk - 1;
  const bool windowed_ahead = window > 0 && !causal;  // bidirectional: the window reaches ahead as far as behind
  if ((causal && k_start > q_last) || (window > 0 && q_start - k_last >= window) ||
      (windowed_ahead && k_start - q_last >= window)) {
    mask.skip = true;  // every key lies after every query, or beyond every query's window
    return mask;
  }
  const bool packed = q_segments.defined() && k_segments.defined();
  const bool partly_after = causal && k_last > q_start;  // some key lies after some query
  const bool partly_behind = window > 0 && q_last - k_start >= window;  // some key behind some query's window
  const bool partly_ahead = windowed_ahead && k_last - q_start >= window;  // some key beyond it ahead
  if (partly_after && !partly_behind && !packed && q_start == k_start && sq == sk) {
    mask.causal = true;  // the diagonal block: the kernels' causal mask, no tensor
    return mask;
  }
  if (partly_behind || partly_ahead) {  // the band: tiles build their own masks
    mask.window = window;
    mask.window_ahead = windowed_ahead;
    mask.q_segments = packed ? q_segments : at::Tensor();
    mask.k_segments = packed ? k_segments : at::Tensor();
    return mask;
  }
  if (partly_after) {
    auto opts = at::TensorOptions().dtype(at::kLong).device(device);
    auto q_pos = at::arange(q_start, q_start + sq, opts).view({sq, 1});
    auto k_pos = at::arange(k_start, k_start + sk, opts).view({1, sk});
    mask.allowed = k_pos.le(q_pos).view({1, 1, 1, sq, sk});
  }
  if (packed) {
    const int64_t b = q_segments.size(0);
    auto same = q_segments.view({b, 1, 1, sq, 1}).eq(k_segments.view({b, 1, 1, 1, sk}));
    mask.allowed = mask.allowed.defined() ? mask.allowed.logical_and(same) : same;
  }
  return mask;
}

at::Tensor finite_lse(const at::Tensor& lse) {
  return lse.masked_fill(lse.eq(-std::numeric_limits<double>::infinity()), 0);
}

namespace {

// The mask as a tensor for the matmul path (the causal diagonal built here), or undefined.
at::Tensor mask_tensor(const BlockMask& mask, int64_t sq, int64_t sk, c10::Device device) {
  if (!mask.causal) {
    return mask.allowed;
  }
  return at::ones({sq, sk}, at::TensorOptions().dtype(at::kBool).device(device)).tril().view({1, 1, 1, sq, sk});
}

// q k^T * scale, capped to softcap * tanh(s / softcap) where asked, plus ALiBi's slope * (j - i) where
// asked (j, i: the key's and the query's global positions), with disallowed keys at -inf:
// [b, hk, g * sq, sk]. cap_slope, where given, receives the cap's derivative 1 - tanh^2 (unmasked).
at::Tensor scores(const at::Tensor& q, const at::Tensor& k, const BlockMask& mask, const Shapes& shapes,
                  at::Tensor* cap_slope = nullptr) {
  auto s = at::matmul(q, k.transpose(-1, -2)).mul_(shapes.scale);
  if (shapes.softcap > 0) {
    s.div_(shapes.softcap).tanh_();
    if (cap_slope != nullptr) {
      *cap_slope = s.square().neg_().add_(1);
    }
    s.mul_(shapes.softcap);
  }
  const int64_t sq = q.size(2) / shapes.groups, sk = s.size(-1);
  if (shapes.alibi.defined()) {
    auto opts = s.options();
    auto distance = at::arange(mask.k_start, mask.k_start + sk, opts).view({1, sk}) -
                    at::arange(mask.q_start, mask.q_start + sq, opts).view({sq, 1});
    s.view({s.size(0), s.size(1), shapes.groups, sq, sk}).add_(shapes.alibi * distance);
  }
  auto allowed = mask_tensor(mask, sq, sk, q.device());
  if (allowed.defined()) {
    s.view({s.size(0), s.size(1), shapes.groups, sq, sk})
        .masked_fill_(allowed.logical_not(), -std::numeric_limits<double>::infinity());
  }
  return s;
}

// Matmul + softmax: [sq, sk] scores per head in the accumulation dtype.
std::pair<at::Tensor, at::Tensor> matmul_block_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                       const BlockMask& mask, const Shapes& shapes) {
  const auto acc = shapes.acc_dtype;
  auto s = scores(q.to(acc), k.to(acc), mask, shapes);
  auto lse = at::logsumexp(s, -1, /*keepdim=*/true);
  auto probs = s.sub_(finite_lse(lse)).exp_();
  return {at::matmul(probs, v.to(acc)), lse.squeeze(-1)};
}

void matmul_block_backward(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                           const at::Tensor& dout_in, const at::Tensor& out, const at::Tensor& lse,
                           const BlockMask& mask, const Shapes& shapes, at::Tensor& dq, at::Tensor& dk,
                           at::Tensor& dv) {
  const auto acc = shapes.acc_dtype;
  const auto q = q_in.to(acc), k = k_in.to(acc), v = v_in.to(acc), dout = dout_in.to(acc);
  const auto delta = (dout * out.to(acc)).sum(-1);  // rowsum(dO * O), as flash attention's backward
  at::Tensor cap_slope;  // defined under a softcap: dS reaches the uncapped scores through it
  auto probs = scores(q, k, mask, shapes, &cap_slope).sub_(finite_lse(lse).unsqueeze(-1)).exp_();
  accumulate_grad(dv, at::matmul(probs.transpose(-1, -2), dout), acc);  // sums the query groups of each key head
  auto ds = at::matmul(dout, v.transpose(-1, -2)).sub_(delta.unsqueeze(-1)).mul_(probs);
  if (cap_slope.defined()) {
    ds.mul_(cap_slope);
  }
  accumulate_grad(dq, at::matmul(ds, k).mul_(shapes.scale), acc);
  accumulate_grad(dk, at::matmul(ds.transpose(-1, -2), q).mul_(shapes.scale), acc);
}

// One query tile of a band: its rows [r0, r1) of the block, the keys [c0, c1) its window reaches
// (causal: none after its last query; bidirectional: as far ahead as behind), and their mask.
struct Tile {
  int64_t r0, r1, c0, c1;
  BlockMask mask;
};

std::vector<Tile> band_tiles(const BlockMask& band, int64_t sq, int64_t sk, c10::Device device) {
  std::vector<Tile> tiles;
  const int64_t w = band.window, ahead = band.window_ahead ? w - 1 : 0;
  for (int64_t r0 = 0; r0 < sq; r0 += w) {
    const int64_t r1 = std::min(sq, r0 + w);
    const int64_t first = band.q_start + r0 - w + 1, last = band.q_start + r1 - 1 + ahead;  // global key range seen
    const int64_t c0 = std::max<int64_t>(0, first - band.k_start), c1 = std::min(sk, last - band.k_start + 1);
    if (c0 >= c1) {
      continue;  // the tile's windows miss the block
    }
    auto opts = at::TensorOptions().dtype(at::kLong).device(device);
    auto q_pos = at::arange(band.q_start + r0, band.q_start + r1, opts).view({r1 - r0, 1});
    auto k_pos = at::arange(band.k_start + c0, band.k_start + c1, opts).view({1, c1 - c0});
    BlockMask mask;
    mask.q_start = band.q_start + r0;
    mask.k_start = band.k_start + c0;
    auto distance = q_pos.sub(k_pos);
    mask.allowed = (band.window_ahead ? distance.abs().lt(w) : k_pos.le(q_pos).logical_and_(distance.lt(w)))
                       .view({1, 1, 1, r1 - r0, c1 - c0});
    if (band.q_segments.defined()) {
      const int64_t b = band.q_segments.size(0);
      auto q_seg = band.q_segments.narrow(1, r0, r1 - r0).reshape({b, 1, 1, r1 - r0, 1});
      auto k_seg = band.k_segments.narrow(1, c0, c1 - c0).reshape({b, 1, 1, 1, c1 - c0});
      mask.allowed = mask.allowed.logical_and(q_seg.eq(k_seg));
    }
    tiles.push_back(Tile{r0, r1, c0, c1, std::move(mask)});
  }
  return tiles;
}

// Rows [r0, r1) of every query group of a grouped [b, hk, g * sq, ...] tensor, as [b, hk, g * (r1 - r0), ...].
at::Tensor tile_rows(const at::Tensor& t, const Shapes& shapes, int64_t sq, int64_t r0, int64_t r1) {
  auto shape = t.sizes().vec();
  std::vector<int64_t> grouped{shape[0], shape[1], shapes.groups, sq};
  grouped.insert(grouped.end(), shape.begin() + 3, shape.end());
  std::vector<int64_t> folded{shape[0], shape[1], shapes.groups * (r1 - r0)};
  folded.insert(folded.end(), shape.begin() + 3, shape.end());
  return t.reshape(grouped).narrow(3, r0, r1 - r0).reshape(folded);
}

// The grouped [b, hk, g, sq, ...] view of a [b, hk, g * sq, ...] tensor's rows [r0, r1), to write into.
at::Tensor rows_view(at::Tensor& t, const Shapes& shapes, int64_t sq, int64_t r0, int64_t r1) {
  auto shape = t.sizes().vec();
  std::vector<int64_t> grouped{shape[0], shape[1], shapes.groups, sq};
  grouped.insert(grouped.end(), shape.begin() + 3, shape.end());
  return t.view(grouped).narrow(3, r0, r1 - r0);
}

std::pair<at::Tensor, at::Tensor> band_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                               const BlockMask& band, const Shapes& shapes) {
  const int64_t sq = q.size(2) / shapes.groups, sk = k.size(2);
  const auto acc = q.options().dtype(shapes.acc_dtype);
  auto out = at::zeros({q.size(0), q.size(1), q.size(2), v.size(3)}, acc);
  auto lse = at::full({q.size(0), q.size(1), q.size(2)}, -std::numeric_limits<double>::infinity(), acc);
  for (const auto& tile : band_tiles(band, sq, sk, q.device())) {
    auto [tile_out, tile_lse] = matmul_block_forward(tile_rows(q, shapes, sq, tile.r0, tile.r1),
                                                     k.narrow(2, tile.c0, tile.c1 - tile.c0),
                                                     v.narrow(2, tile.c0, tile.c1 - tile.c0), tile.mask, shapes);
    const int64_t n = tile.r1 - tile.r0;
    rows_view(out, shapes, sq, tile.r0, tile.r1).copy_(tile_out.view({q.size(0), q.size(1), shapes.groups, n, -1}));
    rows_view(lse, shapes, sq, tile.r0, tile.r1).copy_(tile_lse.view({q.size(0), q.size(1), shapes.groups, n}));
  }
  return {out, lse};
}

void band_backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& dout,
                   const at::Tensor& out, const at::Tensor& lse, const BlockMask& band, const Shapes& shapes,
                   at::Tensor& dq, at::Tensor& dk, at::Tensor& dv) {
  const int64_t sq = q.size(2) / shapes.groups, sk = k.size(2);
  const auto acc = q.options().dtype(shapes.acc_dtype);
  auto band_dq = at::zeros(q.sizes(), acc), band_dk = at::zeros(k.sizes(), acc), band_dv = at::zeros(v.sizes(), acc);
  for (const auto& tile : band_tiles(band, sq, sk, q.device())) {
    at::Tensor tile_dq, tile_dk, tile_dv;
    const int64_t c = tile.c1 - tile.c0, n = tile.r1 - tile.r0;
    matmul_block_backward(tile_rows(q, shapes, sq, tile.r0, tile.r1), k.narrow(2, tile.c0, c),
                          v.narrow(2, tile.c0, c), tile_rows(dout, shapes, sq, tile.r0, tile.r1),
                          tile_rows(out, shapes, sq, tile.r0, tile.r1), tile_rows(lse, shapes, sq, tile.r0, tile.r1),
                          tile.mask, shapes, tile_dq, tile_dk, tile_dv);
    rows_view(band_dq, shapes, sq, tile.r0, tile.r1).add_(tile_dq.view({q.size(0), q.size(1), shapes.groups, n, -1}));
    band_dk.narrow(2, tile.c0, c).add_(tile_dk);
    band_dv.narrow(2, tile.c0, c).add_(tile_dv);
  }
  accumulate_grad(dq, band_dq, shapes.acc_dtype);
  accumulate_grad(dk, band_dk, shapes.acc_dtype);
  accumulate_grad(dv, band_dv, shapes.acc_dtype);
}

}  // namespace

std::pair<at::Tensor, at::Tensor> block_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                const BlockMask& mask, const Shapes& shapes) {
  if (mask.window > 0) {
    return band_forward(q, k, v, mask, shapes);
  }
  const auto kernel = choose_kernel(q, k, mask, shapes);
  if (kernel == BlockKernel::Matmul) {
    return matmul_block_forward(q, k, v, mask, shapes);
  }
  return fused_block_forward(kernel, q, k, v, mask.causal, shapes);
}

void merge_block(at::Tensor& out, at::Tensor& lse, at::Tensor block_out, const at::Tensor& block_lse) {
  if (!out.defined()) {  // no zero-filled accumulator to merge into: saves a pass over [b, h, s, d]
    out = std::move(block_out);
    lse = block_lse;
    return;
  }
  auto merged = at::logaddexp(lse, block_lse);
  auto base = finite_lse(merged);
  auto keep = at::exp(lse - base).unsqueeze(-1);
  auto take = at::exp(block_lse - base).unsqueeze(-1);
  const auto acc = lse.scalar_type();  // a fused kernel's output is in the input dtype: widened to merge
  out = out.scalar_type() == acc ? out.mul_(keep) : out.to(acc).mul_(keep);
  out.add_(block_out.scalar_type() == acc ? block_out.mul_(take) : block_out.to(acc).mul_(take));
  lse = merged;
}

void accumulate_grad(at::Tensor& sum, const at::Tensor& grad, at::ScalarType acc_dtype) {
  if (!sum.defined()) {
    sum = grad;  // a block's fresh gradient, in its kernel's dtype until a second block's is added
  } else if (sum.scalar_type() == acc_dtype) {
    sum.add_(grad);  // in place: sum may be a view of a caller's buffer
  } else {
    sum = sum.to(acc_dtype).add_(grad);
  }
}

void fill_unreached(at::Tensor& out, at::Tensor& lse, const at::Tensor& query_piece, at::ScalarType acc_dtype) {
  if (out.defined()) {
    return;
  }
  const auto acc = query_piece.options().dtype(acc_dtype);
  out = at::zeros(query_piece.sizes(), acc);
  lse = at::full(query_piece.sizes().slice(0, 3), -std::numeric_limits<double>::infinity(), acc);
}

void block_backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& dout,
                    const at::Tensor& out, const at::Tensor& lse, const BlockMask& mask, const Shapes& shapes,
                    at::Tensor& dq, at::Tensor& dk, at::Tensor& dv) {
  if (mask.window > 0) {
    band_backward(q, k, v, dout, out, lse, mask, shapes, dq, dk, dv);
    return;
  }
  const auto kernel = choose_kernel(q, k, mask, shapes);
  if (kernel == BlockKernel::Matmul) {
    matmul_block_backward(q, k, v, dout, out, lse, mask, shapes, dq, dk, dv);
    return;
  }
  fused_block_backward(kernel, q, k, v, dout, out, lse, mask.causal, shapes, dq, dk, dv);
}

Exchange::Exchange(c10d::ProcessGroup& group, at::Tensor send, at::Tensor recv, int dst, int src, int tag)
    : send_(std::move(send)), recv_(std::move(recv)) {
  std::vector<at::Tensor> sends{send_}, recvs{recv_};
  const auto device_type = send_.device().type();
  if (group.getBackend(device_type)->supportsCoalescing()) {
    group.startCoalescing(device_type);
    group.send(sends, dst, tag);
    group.recv(recvs, src, tag);
    works_.push_back(group.endCoalescing(device_type));
  } else {
    works_.push_back(group.send(sends, dst, tag));
    works_.push_back(group.recv(recvs, src, tag));
  }
}

at::Tensor Exchange::wait() {
  for (auto& work : works_) {
    if (work) {
      work->wait();
    }
  }
  works_.clear();
  send_ = at::Tensor();
  return recv_;
}

c10::intrusive_ptr<c10d::ProcessGroup> cp_group(const at::Tensor& like, const std::string& group_name,
                                                 int64_t group_size, const char* op_name) {
  auto group = resolve_group(group_name);
  check_group_size(*group, group_name, group_size, op_name);
  check_device_supported(*group, group_name, like, op_name);
  return group;
}

at::Tensor all_gather_stacked(c10d::ProcessGroup& group, const at::Tensor& local) {
  auto input = local.contiguous().view({-1});  // flat buffers: what every backend accepts
  auto sizes = local.sizes().vec();
  sizes.insert(sizes.begin(), group.getSize());
  auto gathered = at::empty({input.numel() * group.getSize()}, input.options());
  c10d_compat::all_gather_single(group, gathered, input)->wait();
  return gathered.view(sizes);
}

}  // namespace torchpp::cp
