// The all-to-all attention ops' exchange of heads for the sequence (DeepSpeed-Ulysses): this rank's
// shard of every head in, its 1/c of the heads over the whole sequence out, and back.
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "ops/c10d_compat.h"
#include "ops/context_parallel.h"

namespace torchpp::cp {
namespace {

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

}  // namespace

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

// [b, H, s_local, ...], this rank's shard of every head -> [b, H / c, s, ...], this rank's heads
// over the whole sequence.
at::Tensor heads_to_sequence(c10d::ProcessGroup& group, const at::Tensor& x, Layout layout) {
  const int64_t c = group.getSize();
  auto sizes = x.sizes().vec();
  std::vector<int64_t> split{sizes[0], c, sizes[1] / c};
  split.insert(split.end(), sizes.begin() + 2, sizes.end());
  return in_sequence_order(exchange(group, x.reshape(split).transpose(0, 1)), layout, 2);
}

// The inverse: [b, H / c, s, ...] -> [b, H, s_local, ...].
at::Tensor sequence_to_heads(c10d::ProcessGroup& group, const at::Tensor& y, Layout layout) {
  const int64_t c = group.getSize();
  const int64_t n = y.size(2) / (layout == Layout::Zigzag ? 2 * c : c);
  std::vector<at::Tensor> shards;
  for (int64_t r = 0; r < c; ++r) {
    std::vector<at::Tensor> held;
    for (auto chunk : chunks_of(r, c, layout)) {
      held.push_back(y.narrow(2, chunk * n, n));
    }
    shards.push_back(held.size() == 1 ? held[0] : at::cat(held, 2));
  }
  auto received = exchange(group, at::stack(shards));  // [c (head group), b, H / c, s_local, ...]
  auto sizes = received.sizes().vec();
  std::vector<int64_t> joined{sizes[1], sizes[0] * sizes[2]};
  joined.insert(joined.end(), sizes.begin() + 3, sizes.end());
  return received.transpose(0, 1).reshape(joined);
}

}  // namespace torchpp::cp
