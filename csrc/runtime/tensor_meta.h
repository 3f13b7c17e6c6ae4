// Shapes and dtypes of pipeline messages, and their fixed-size wire form (an int64 header
// tensor) exchanged between neighbouring stages before the data the first time, or when
// shapes change. A message carries what a stage passes to the next one (one tensor or a tuple
// of them, as torch.distributed.pipelining allows) or, backwards, the gradients of its
// floating-point entries.
#pragma once

#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

namespace torchpp::runtime {

using Tensors = std::vector<at::Tensor>;

struct TensorMeta {
  c10::ScalarType dtype = c10::ScalarType::Float;
  std::vector<int64_t> shape;

  static TensorMeta of(const at::Tensor& tensor);
  int64_t numel() const;
  // "[4, 16] Double"
  std::string str() const;
  bool operator==(const TensorMeta& other) const { return dtype == other.dtype && shape == other.shape; }
  bool operator!=(const TensorMeta& other) const { return !(*this == other); }
};

// Whether a tensor of this dtype gets a gradient sent back to the stage that produced it.
bool carries_gradient(c10::ScalarType dtype);

struct MessageMeta {
  std::vector<TensorMeta> tensors;

  static MessageMeta of(const Tensors& tensors);
  // Inverse of encode(); raises on a header that is not one.
  static MessageMeta decode(const at::Tensor& header);
  // int64 [count, then per tensor: dtype, ndim, dims..., padding] of kHeaderSlots on `device`.
  at::Tensor encode(c10::Device device) const;
  // The gradient message this one gets back: its entries that carry a gradient, in order.
  MessageMeta gradients() const;
  bool empty() const { return tensors.empty(); }
  // "[4, 16] Double", or "([4, 16] Double, [4] Long)" for several tensors
  std::string str() const;
  bool operator==(const MessageMeta& other) const { return tensors == other.tensors; }
  bool operator!=(const MessageMeta& other) const { return !(*this == other); }
};

// Raises PipelineShapeError unless `got` matches `want` (a user's input_args/output_args) in
// count, dtypes and every dimension but the batch one (an uneven last microbatch may be
// smaller). `what`: "received", "returned"; `source`: e.g. "from stage 2", may be empty;
// `given_as`: the argument `want` came from.
void check_expected(const MessageMeta& got, const MessageMeta& want, int64_t stage, int64_t microbatch,
                    const std::string& what, const std::string& source, const std::string& given_as);

constexpr int64_t kMaxDims = 14;
constexpr int64_t kMaxMessageTensors = 8;
constexpr int64_t kTensorSlots = 2 + kMaxDims;
constexpr int64_t kHeaderSlots = 1 + kMaxMessageTensors * kTensorSlots;

}  // namespace torchpp::runtime
