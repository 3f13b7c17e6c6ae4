#include "runtime/tensor_meta.h"

#include <sstream>

#include <ATen/ATen.h>

namespace torchpp::runtime {

TensorMeta TensorMeta::of(const at::Tensor& tensor) {
  return TensorMeta{tensor.scalar_type(), tensor.sizes().vec()};
}

at::Tensor TensorMeta::encode(c10::Device device) const {
  TORCH_CHECK(static_cast<int64_t>(shape.size()) <= kMaxDims, "torchpp pipeline: a stage output of ",
              shape.size(), " dimensions exceeds the supported ", kMaxDims);
  auto header = at::zeros({kHeaderSlots}, at::kLong);
  auto* slots = header.data_ptr<int64_t>();
  slots[0] = static_cast<int64_t>(dtype);
  slots[1] = static_cast<int64_t>(shape.size());
  for (size_t d = 0; d < shape.size(); d++) {
    slots[2 + d] = shape[d];
  }
  return header.to(device);
}

TensorMeta TensorMeta::decode(const at::Tensor& header) {
  auto host = header.to(at::kCPU).contiguous();
  const auto* slots = host.data_ptr<int64_t>();
  TORCH_CHECK(slots[1] >= 0 && slots[1] <= kMaxDims, "torchpp pipeline: corrupt metadata header (ndim ", slots[1], ")");
  TensorMeta meta;
  meta.dtype = static_cast<c10::ScalarType>(slots[0]);
  meta.shape.assign(slots + 2, slots + 2 + slots[1]);
  return meta;
}

int64_t TensorMeta::numel() const {
  int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

std::string TensorMeta::str() const {
  std::ostringstream out;
  out << c10::IntArrayRef(shape) << " " << dtype;
  return out.str();
}

}  // namespace torchpp::runtime
