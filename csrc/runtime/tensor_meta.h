// Shape and dtype of a pipeline message, and its fixed-size wire form (an int64 header tensor)
// exchanged between neighbouring stages before the data the first time, or when shapes change.
#pragma once

#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

namespace torchpp::runtime {

struct TensorMeta {
  c10::ScalarType dtype = c10::ScalarType::Float;
  std::vector<int64_t> shape;

  static TensorMeta of(const at::Tensor& tensor);
  // Inverse of encode(); raises on a header that is not one.
  static TensorMeta decode(const at::Tensor& header);
  // int64 [dtype, ndim, dims..., padding] of kHeaderSlots elements on `device`.
  at::Tensor encode(c10::Device device) const;
  int64_t numel() const;
  // "[4, 16] Double"
  std::string str() const;
  bool operator==(const TensorMeta& other) const { return dtype == other.dtype && shape == other.shape; }
  bool operator!=(const TensorMeta& other) const { return !(*this == other); }
};

constexpr int64_t kMaxDims = 14;
constexpr int64_t kHeaderSlots = 2 + kMaxDims;

}  // namespace torchpp::runtime
