// Context parallelism: attention over a sequence split across the ranks of a group.
// Each rank holds its shard of q, k, v ([b, heads, s_local, d]); the shard is one chunk of the
// sequence (contiguous layout) or two (zigzag: rank r holds chunks r and 2c-1-r of 2c, so that
// causal attention costs every rank the same). Block results are merged by log-sum-exp, and
// the backward recomputes each block's probabilities from the merged log-sum-exp (as flash
// attention does), so only q, k, v, the output and the log-sum-exp are saved.
#pragma once

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <c10/util/flat_hash_map.h>
#include <c10/util/intrusive_ptr.h>
#include <c10/util/string_view.h>

namespace c10d {
class ProcessGroup;
class Work;
}  // namespace c10d

namespace torchpp::cp {

enum class Layout { Contiguous, Zigzag };

// An optional tensor argument that was given (and is defined).
inline bool has(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

Layout parse_layout(c10::string_view layout, const char* op_name);

// Global chunk indices held by `rank` of `world`, in shard order (1 or 2 chunks).
std::vector<int64_t> chunks_of(int64_t rank, int64_t world, Layout layout);

// Validated sizes of one call. Queries are kept grouped by the key/value head they share:
// [b, kv_heads, groups * piece, d] per piece, so a block is one batched matmul with no copies
// of k or v (grouped-query attention).
struct Shapes {
  int64_t batch = 0, q_heads = 0, kv_heads = 0, groups = 0, s_local = 0, head_dim = 0;
  int64_t pieces = 0, piece_len = 0;  // chunks per rank and their length
  double scale = 0.0;
  at::ScalarType acc_dtype;  // float for half/bfloat16 inputs, else the input dtype
  // sliding window: query i sees keys j with i - window < j (0: every earlier key); without causality,
  // |i - j| < window
  int64_t window = 0;
  double softcap = 0.0;  // scores capped to softcap * tanh(s / softcap) (0: none); the matmul path alone
  // ALiBi: slope_h * (key position - query position) added to head h's scores, as [1, hk, g, 1, 1]
  // in the accumulation dtype (undefined: none); the matmul path alone.
  at::Tensor alibi;
};

Shapes check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const std::optional<at::Tensor>& segment_ids, std::optional<double> scale,
                    Layout layout, int64_t group_size, bool causal, int64_t window, double softcap,
                    const std::optional<at::Tensor>& alibi_slopes, const char* op_name);

// [b, hq, s, ...] -> one grouped tensor per piece, [b, hk, g * n, ...] in `dtype`.
std::vector<at::Tensor> split_queries(const at::Tensor& t, const Shapes& shapes, at::ScalarType dtype);
// The inverse: pieces [b, hk, g * n, ...] -> [b, hq, s, ...] in `dtype`.
at::Tensor join_queries(const std::vector<at::Tensor>& pieces, const Shapes& shapes, at::ScalarType dtype);

// Which key positions a block of queries may see: `skip` when none; `causal` for a square block
// on the diagonal (query i sees keys 0..i: the fused kernels' own causal mask); else an optional
// boolean mask broadcastable to [b, hk, g, sq, sk] (undefined and not causal: all keys).
struct BlockMask {
  bool skip = false;
  bool causal = false;
  at::Tensor allowed;
  // A sliding window cutting through the block (allowed then undefined): computed as a band of
  // query tiles window long, each against the keys its window reaches, so no [sq, sk] scores.
  int64_t window = 0;
  bool window_ahead = false;  // bidirectional attention's window: keys ahead too, |i - j| < window
  int64_t q_start = 0, k_start = 0;  // global positions of the block's first query and key (ALiBi's bias)
  at::Tensor q_segments, k_segments;  // [b, sq], [b, sk] of packed rows, or undefined
};

// Mask for query positions [q_start, q_start + sq) against keys [k_start, k_start + sk) of the
// global sequence; segment ids ([b, sq], [b, sk], may be undefined) keep packed sequences apart;
// a sliding window (> 0) hides keys window or more positions back, and without causality as
// many ahead (a block wholly beyond it is skipped).
BlockMask block_mask(int64_t q_start, int64_t sq, int64_t k_start, int64_t sk, bool causal, int64_t window,
                     const at::Tensor& q_segments, const at::Tensor& k_segments, c10::Device device);

// How a block is computed. The fused kernels return the log-sum-exp and hold O(s) memory: the CPU
// flash kernel, CUDA's cuDNN (SDPA's choice on Hopper; fp16/bf16 without grouped-query heads),
// flash (fp16/bf16) and memory-efficient (fp32) kernels. Matmul + softmax holds the [sq, sk]
// scores and serves what they cannot: arbitrary masks (packed sequences), capped scores, fp64 on
// CUDA, head sizes the kernels reject.
enum class BlockKernel { Matmul, FlashCpu, Cudnn, Flash, Efficient };

const char* kernel_name(BlockKernel kernel);

// The kernel for this block's shapes, dtype, device and mask (q grouped [b, hk, g * n, d]).
// TORCHPP_CP_KERNEL=matmul forces the matmul path (the benchmark's baseline); =flash keeps blocks
// SDPA would give cuDNN on flash (or memory-efficient) attention.
BlockKernel choose_kernel(const at::Tensor& q, const at::Tensor& k, const BlockMask& mask, const Shapes& shapes);

// Softmax attention of grouped queries ([b, hk, g * n, d], input dtype) against one key/value
// block: (out, lse) in the accumulation dtype, lse = -inf (and out = 0) on rows that see no key.
std::pair<at::Tensor, at::Tensor> block_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                const BlockMask& mask, const Shapes& shapes);

// Folds a block result into running (out, lse) by log-sum-exp; the first block (out undefined)
// becomes them as it is. block_out is a fresh tensor of the block's: it is scaled in place. A fused
// kernel's out (input dtype) is widened to lse's accumulation dtype when a second block joins.
void merge_block(at::Tensor& out, at::Tensor& lse, at::Tensor block_out, const at::Tensor& block_lse);

// sum += grad (in place where sum has the accumulation dtype, else widened to it first), or
// sum = grad where sum is still undefined (a piece's first block: a fused kernel's gradient stays
// in the input dtype it was rounded to, with no zero-filled accumulator).
void accumulate_grad(at::Tensor& sum, const at::Tensor& grad, at::ScalarType acc_dtype);

// A query piece's (out, lse) where no block reached it: 0 and -inf.
void fill_unreached(at::Tensor& out, at::Tensor& lse, const at::Tensor& query_piece, at::ScalarType acc_dtype);

// Adds one block's gradients to dq, dk, dv (accumulate_grad: an undefined one becomes the block's)
// given the merged output `out` (input dtype) and log-sum-exp `lse`: P = exp(S - lse) is then this
// block's share of the softmax.
void block_backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& dout,
                    const at::Tensor& out, const at::Tensor& lse, const BlockMask& mask, const Shapes& shapes,
                    at::Tensor& dq, at::Tensor& dk, at::Tensor& dv);

// The fused kernels' forward and backward for one block (kernel != Matmul), same contracts.
std::pair<at::Tensor, at::Tensor> fused_block_forward(BlockKernel kernel, const at::Tensor& q, const at::Tensor& k,
                                                      const at::Tensor& v, bool causal, const Shapes& shapes);
void fused_block_backward(BlockKernel kernel, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const at::Tensor& dout, const at::Tensor& out, const at::Tensor& lse, bool causal,
                          const Shapes& shapes, at::Tensor& dq, at::Tensor& dk, at::Tensor& dv);

// Rows of `lse` that saw no key read as 0, so exp(s - lse) is 0 there instead of NaN.
at::Tensor finite_lse(const at::Tensor& lse);

// Sinks [hq] (context_parallel_sinks.cpp): checked against the query [b, hq, ...]; folded into a
// finished output [b, hq, s, d] and log-sum-exp [b, hq, s] (each row's denominator gains exp(sink));
// their gradient from the output's, given the folded output and log-sum-exp.
void check_sinks(const at::Tensor& q, const at::Tensor& sinks, const char* op_name);
std::pair<at::Tensor, at::Tensor> fold_sinks(const at::Tensor& out, const at::Tensor& lse, const at::Tensor& sinks);
at::Tensor sinks_grad(const at::Tensor& grad_out, const at::Tensor& out, const at::Tensor& lse,
                      const at::Tensor& sinks);

// The options of an attention call, kept in an autograd context's saved_data for its backward,
// and the scale read back.
using SavedData = ska::flat_hash_map<std::string, at::IValue>;
void save_options(SavedData& saved, c10::string_view group_name, int64_t group_size, bool causal,
                  std::optional<double> scale, c10::string_view layout, int64_t window, double softcap);
std::optional<double> saved_scale(const SavedData& saved);

// A send to `dst` and a receive from `src`, posted together (one NCCL group where the backend
// coalesces, so a ring of sends cannot deadlock) and awaited by wait().
class Exchange {
 public:
  Exchange() = default;
  Exchange(c10d::ProcessGroup& group, at::Tensor send, at::Tensor recv, int dst, int src, int tag);
  // Returns the received tensor.
  at::Tensor wait();
  bool pending() const { return !works_.empty(); }

 private:
  std::vector<c10::intrusive_ptr<c10d::Work>> works_;
  at::Tensor send_, recv_;
};

// The group for the op, checked against group_size and the tensor's device.
c10::intrusive_ptr<c10d::ProcessGroup> cp_group(const at::Tensor& like, const std::string& group_name,
                                                 int64_t group_size, const char* op_name);

// Every rank's `local` stacked rank-major: [c, *local.shape].
at::Tensor all_gather_stacked(c10d::ProcessGroup& group, const at::Tensor& local);

// Heads traded for the sequence over the group named `group_name` (c ranks), through the ops
// torch.ops.torchpp.heads_to_sequence / sequence_to_heads (context_parallel_head_exchange.cpp: each
// the other's gradient; one node each in a trace). heads_to_sequence: [b, H, s_local, ...], this
// rank's shard of every head -> [b, H / c, c * s_local, ...], this rank's heads over the group's
// chunks in sequence order; sequence_to_heads, the inverse. Over a whole cp group that is the whole
// sequence; over an inner group of a consecutive ranks of c = a * c' (all-to-all inside, ring
// across), inner group o's chunks form super-chunk o (and 2c'-1-o under zigzag) of 2c' (c'): the
// shard the same layout gives ring rank o of c'.
at::Tensor heads_to_sequence(const at::Tensor& x, c10::string_view group_name, int64_t group_size,
                             c10::string_view layout);
at::Tensor sequence_to_heads(const at::Tensor& y, c10::string_view group_name, int64_t group_size,
                             c10::string_view layout);
// Every rank's segment ids [b, s_local] of the group, in sequence order: [b, c * s_local].
at::Tensor segments_in_sequence_order(const at::Tensor& segment_ids, c10::string_view group_name,
                                      int64_t group_size, c10::string_view layout);

}  // namespace torchpp::cp
