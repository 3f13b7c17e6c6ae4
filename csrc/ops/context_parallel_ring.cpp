// Ring attention: each rank keeps its queries and passes key/value shards around the ring in
// c-1 steps, posting the next transfer before computing the current block. The backward
// passes key/value the same way and the key/value gradients one step behind them; after the
// last step they arrive back at the shard's owner. Memory per rank: the keys and values travel
// as two messages, the first step sending the inputs themselves (no stacked copy); the first
// step's gradients accumulate straight into the message that carries their sum, and a later
// step's are freed once added to the sum, before the next message's buffer is allocated.
#include <limits>
#include <tuple>

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/library.h>

#include "ops/context_parallel.h"

namespace torchpp::cp {
namespace {

constexpr const char* kOp = "ring_attention";
// Distinct tags keep the key, value and gradient streams apart on backends that match by tag.
constexpr int kKeyTag = 0x6370;
constexpr int kGradTag = 0x6371;
constexpr int kValueTag = 0x6372;

struct Ring {
  c10::intrusive_ptr<c10d::ProcessGroup> group;
  int64_t size = 1, rank = 0;
  int next() const { return static_cast<int>((rank + 1) % size); }
  int prev() const { return static_cast<int>((rank + size - 1) % size); }
  // Whose key/value shard this rank holds at `step`.
  int64_t source(int64_t step) const { return (rank - step + size) % size; }
};

// This rank's segment-id pieces and every rank's ([c, b, s_local], gathered once), or undefined.
at::Tensor gather_segments(Ring& ring, const std::optional<at::Tensor>& segment_ids) {
  if (!segment_ids.has_value() || !segment_ids->defined()) {
    return at::Tensor();
  }
  return all_gather_stacked(*ring.group, segment_ids->to(at::kLong));
}

at::Tensor segment_piece(const at::Tensor& segments, int64_t rank, int64_t piece, const Shapes& shapes) {
  return segments.defined() ? segments[rank].narrow(1, piece * shapes.piece_len, shapes.piece_len) : at::Tensor();
}

// Calls fn(q_piece, k_piece, mask) for every pair of this rank's query pieces and the source's
// key pieces that has something to attend to.
template <class Fn>
void for_each_block(const Ring& ring, int64_t src, Layout layout, bool causal, const Shapes& shapes,
                    const at::Tensor& segments, c10::Device device, Fn&& fn) {
  const auto mine = chunks_of(ring.rank, ring.size, layout);
  const auto theirs = chunks_of(src, ring.size, layout);
  const int64_t n = shapes.piece_len;
  for (int64_t i = 0; i < shapes.pieces; ++i) {
    for (int64_t j = 0; j < shapes.pieces; ++j) {
      auto mask = block_mask(mine[i] * n, n, theirs[j] * n, n, causal, shapes.window,
                             segment_piece(segments, ring.rank, i, shapes),
                             segment_piece(segments, src, j, shapes), device);
      if (!mask.skip) {
        fn(i, j, mask);
      }
    }
  }
}

// The key/value shard a step computes with: the inputs at the first step, then the buffers the
// previous rank's shard arrived in.
struct KeyValues {
  at::Tensor keys, values;
};

// One step's key/value transfer: this rank's shard to the next rank, the previous rank's in.
class KeyValueExchange {
 public:
  KeyValueExchange() = default;
  KeyValueExchange(const Ring& ring, const KeyValues& kv)
      : keys_(*ring.group, kv.keys, at::empty_like(kv.keys), ring.next(), ring.prev(), kKeyTag),
        values_(*ring.group, kv.values, at::empty_like(kv.values), ring.next(), ring.prev(), kValueTag) {}
  bool pending() const { return keys_.pending(); }
  KeyValues wait() { return {keys_.wait(), values_.wait()}; }

 private:
  Exchange keys_, values_;
};

// Calls fn(piece of `message` ([dk, dv] stacked), that piece's gradient or undefined) for every key piece.
template <class Fn>
void for_each_key_piece(at::Tensor& message, const std::vector<at::Tensor>& dks, const std::vector<at::Tensor>& dvs,
                        int64_t piece_len, Fn&& fn) {
  for (size_t j = 0; j < dks.size(); ++j) {
    for (const auto& [slot, grad] : {std::pair{0, &dks[j]}, std::pair{1, &dvs[j]}}) {
      auto piece = message[slot].narrow(2, static_cast<int64_t>(j) * piece_len, piece_len);
      fn(piece, *grad);
    }
  }
}

// The message that carries a shard's key/value gradient sum ([dk, dv] in the accumulation dtype,
// zeros), with each key piece's gradient accumulators set to views of it: the first step's blocks
// accumulate into it in place.
at::Tensor key_value_grads_in_place(std::vector<at::Tensor>& dks, std::vector<at::Tensor>& dvs,
                                    at::IntArrayRef stacked_sizes, const at::TensorOptions& acc, int64_t piece_len) {
  auto message = at::zeros(stacked_sizes, acc);
  for (size_t j = 0; j < dks.size(); ++j) {
    dks[j] = message[0].narrow(2, static_cast<int64_t>(j) * piece_len, piece_len);
    dvs[j] = message[1].narrow(2, static_cast<int64_t>(j) * piece_len, piece_len);
  }
  return message;
}

// A later step's gradients added into the running sum received from the previous rank, which then
// travels on: no second float32 message per step.
void add_key_value_grads(at::Tensor& sum, const std::vector<at::Tensor>& dks, const std::vector<at::Tensor>& dvs,
                         int64_t piece_len) {
  for_each_key_piece(sum, dks, dvs, piece_len, [](at::Tensor& piece, const at::Tensor& grad) {
    if (grad.defined()) {
      piece.add_(grad);
    }
  });
}

// A one-rank ring's key (or value) gradient from its pieces, in the input's dtype.
at::Tensor join_key_pieces(const std::vector<at::Tensor>& pieces, const at::Tensor& like, const Shapes& shapes) {
  std::vector<at::Tensor> parts;
  for (size_t j = 0; j < pieces.size(); ++j) {
    parts.push_back(pieces[j].defined() ? pieces[j].to(like.scalar_type())
                                        : at::zeros_like(like.narrow(2, static_cast<int64_t>(j) * shapes.piece_len,
                                                                     shapes.piece_len)));
  }
  return parts.size() == 1 ? parts[0] : at::cat(parts, 2);
}

Ring make_ring(const at::Tensor& like, c10::string_view group_name, int64_t group_size) {
  Ring ring;
  ring.group = cp_group(like, std::string(group_name), group_size, kOp);
  ring.size = group_size;
  ring.rank = ring.group->getRank();
  return ring;
}

std::tuple<at::Tensor, at::Tensor> ring_attention_forward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& segment_ids,
    c10::string_view group_name, int64_t group_size, bool causal, std::optional<double> scale,
    c10::string_view layout_name, int64_t window,
    double softcap, const std::optional<at::Tensor>& alibi_slopes) {
  const Layout layout = parse_layout(layout_name, kOp);
  const Shapes shapes =
      check_inputs(q, k, v, segment_ids, scale, layout, group_size, causal, window, softcap, alibi_slopes, kOp);
  Ring ring = make_ring(q, group_name, group_size);
  const at::Tensor segments = gather_segments(ring, segment_ids);
  auto queries = split_queries(q, shapes, q.scalar_type());
  std::vector<at::Tensor> outs(queries.size()), lses(queries.size());  // set by each piece's first block
  const int64_t n = shapes.piece_len;
  KeyValues kv{k.contiguous(), v.contiguous()};
  for (int64_t step = 0; step < ring.size; ++step) {
    KeyValueExchange incoming;
    if (step + 1 < ring.size) {  // posted before this block's compute, so the two overlap
      incoming = KeyValueExchange(ring, kv);
    }
    {
      RECORD_FUNCTION("torchpp::ring_attention::block", std::vector<c10::IValue>());
      for_each_block(ring, ring.source(step), layout, causal, shapes, segments, q.device(),
                     [&](int64_t i, int64_t j, const BlockMask& mask) {
                       auto [out, lse] = block_forward(queries[i], kv.keys.narrow(2, j * n, n),
                                                       kv.values.narrow(2, j * n, n), mask, shapes);
                       merge_block(outs[i], lses[i], std::move(out), lse);
                     });
    }
    if (incoming.pending()) {
      RECORD_FUNCTION("torchpp::ring_attention::wait", std::vector<c10::IValue>());
      kv = incoming.wait();
    }
  }
  for (size_t i = 0; i < queries.size(); ++i) {
    fill_unreached(outs[i], lses[i], queries[i], shapes.acc_dtype);
  }
  return {join_queries(outs, shapes, q.scalar_type()), join_queries(lses, shapes, shapes.acc_dtype)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> ring_attention_backward(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const std::optional<at::Tensor>& segment_ids, c10::string_view group_name,
    int64_t group_size, bool causal, std::optional<double> scale, c10::string_view layout_name, int64_t window,
    double softcap, const std::optional<at::Tensor>& alibi_slopes) {
  const Layout layout = parse_layout(layout_name, kOp);
  const Shapes shapes =
      check_inputs(q, k, v, segment_ids, scale, layout, group_size, causal, window, softcap, alibi_slopes, kOp);
  Ring ring = make_ring(q, group_name, group_size);
  const at::Tensor segments = gather_segments(ring, segment_ids);
  auto queries = split_queries(q, shapes, q.scalar_type());
  auto grads = split_queries(grad_out, shapes, q.scalar_type());
  auto lses = split_queries(lse, shapes, shapes.acc_dtype);
  auto outs = split_queries(out, shapes, q.scalar_type());
  std::vector<at::Tensor> dqs(queries.size());  // set by each piece's first block
  const int64_t n = shapes.piece_len;
  KeyValues kv{k.contiguous(), v.contiguous()};
  auto stacked_sizes = k.sizes().vec();
  stacked_sizes.insert(stacked_sizes.begin(), 2);
  KeyValueExchange incoming;
  Exchange gradients;
  at::Tensor own_k, own_v;
  for (int64_t step = 0; step < ring.size; ++step) {
    if (step + 1 < ring.size) {
      incoming = KeyValueExchange(ring, kv);
    }
    std::vector<at::Tensor> dks(shapes.pieces), dvs(shapes.pieces);  // this step's, per key piece
    at::Tensor block_grads;
    if (step == 0 && ring.size > 1) {  // the first step's gradients start the sum that travels
      block_grads = key_value_grads_in_place(dks, dvs, stacked_sizes, k.options().dtype(shapes.acc_dtype), n);
    }
    {
      RECORD_FUNCTION("torchpp::ring_attention::block_backward", std::vector<c10::IValue>());
      for_each_block(ring, ring.source(step), layout, causal, shapes, segments, q.device(),
                     [&](int64_t i, int64_t j, const BlockMask& mask) {
                       block_backward(queries[i], kv.keys.narrow(2, j * n, n), kv.values.narrow(2, j * n, n),
                                      grads[i], outs[i], lses[i], mask, shapes, dqs[i], dks[j], dvs[j]);
                     });
    }
    if (ring.size == 1) {  // nothing to send: the pieces are the gradients
      own_k = join_key_pieces(dks, k, shapes);
      own_v = join_key_pieces(dvs, v, shapes);
      break;
    }
    if (gradients.pending()) {  // the sum so far for this key/value shard, from the previous rank
      RECORD_FUNCTION("torchpp::ring_attention::wait", std::vector<c10::IValue>());
      block_grads = gradients.wait();
      add_key_value_grads(block_grads, dks, dvs, n);
    }
    dks.clear();  // added in: freed before the next message's buffer is allocated
    dvs.clear();
    // After the last step this send delivers the sum to the shard's owner.
    gradients = Exchange(*ring.group, block_grads, at::empty_like(block_grads), ring.next(), ring.prev(), kGradTag);
    if (incoming.pending()) {
      RECORD_FUNCTION("torchpp::ring_attention::wait", std::vector<c10::IValue>());
      kv = incoming.wait();
    }
  }
  if (gradients.pending()) {
    const auto own_grads = gradients.wait();
    own_k = own_grads[0].to(k.scalar_type());
    own_v = own_grads[1].to(v.scalar_type());
  }
  for (size_t i = 0; i < queries.size(); ++i) {
    if (!dqs[i].defined()) {  // no block reached the piece
      dqs[i] = at::zeros(queries[i].sizes(), queries[i].options().dtype(shapes.acc_dtype));
    }
  }
  return {join_queries(dqs, shapes, q.scalar_type()), own_k.contiguous(), own_v.contiguous()};  // (as the fakes)
}

}  // namespace

TORCH_LIBRARY_IMPL(torchpp, CompositeExplicitAutograd, m) {
  m.impl("ring_attention_forward", TORCH_FN(ring_attention_forward));
  m.impl("ring_attention_backward", TORCH_FN(ring_attention_backward));
}

}  // namespace torchpp::cp
