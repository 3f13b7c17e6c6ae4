#include "runtime/tensor_meta.h"

#include <algorithm>
#include <sstream>

#include <ATen/ATen.h>

#include "runtime/failure.h"

namespace torchpp::runtime {

TensorMeta TensorMeta::of(const at::Tensor& tensor) {
  return TensorMeta{tensor.scalar_type(), tensor.sizes().vec()};
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

bool carries_gradient(c10::ScalarType dtype) {
  return at::isFloatingType(dtype) || at::isComplexType(dtype);
}

MessageMeta MessageMeta::of(const Tensors& tensors) {
  MessageMeta meta;
  meta.tensors.reserve(tensors.size());
  for (const auto& tensor : tensors) meta.tensors.push_back(TensorMeta::of(tensor));
  return meta;
}

at::Tensor MessageMeta::encode(c10::Device device) const {
  TORCH_CHECK(static_cast<int64_t>(tensors.size()) <= kMaxMessageTensors, "torchpp pipeline: a stage output of ",
              tensors.size(), " tensors exceeds the supported ", kMaxMessageTensors);
  auto header = at::zeros({kHeaderSlots}, at::kLong);
  auto* slots = header.data_ptr<int64_t>();
  slots[0] = static_cast<int64_t>(tensors.size());
  for (size_t t = 0; t < tensors.size(); t++) {
    const auto& meta = tensors[t];
    TORCH_CHECK(static_cast<int64_t>(meta.shape.size()) <= kMaxDims, "torchpp pipeline: a stage output of ",
                meta.shape.size(), " dimensions exceeds the supported ", kMaxDims);
    int64_t* entry = slots + 1 + t * kTensorSlots;
    entry[0] = static_cast<int64_t>(meta.dtype);
    entry[1] = static_cast<int64_t>(meta.shape.size());
    for (size_t d = 0; d < meta.shape.size(); d++) entry[2 + d] = meta.shape[d];
  }
  return header.to(device);
}

MessageMeta MessageMeta::decode(const at::Tensor& header) {
  auto host = header.to(at::kCPU).contiguous();
  const auto* slots = host.data_ptr<int64_t>();
  TORCH_CHECK(slots[0] >= 0 && slots[0] <= kMaxMessageTensors, "torchpp pipeline: corrupt metadata header (",
              slots[0], " tensors)");
  MessageMeta meta;
  for (int64_t t = 0; t < slots[0]; t++) {
    const int64_t* entry = slots + 1 + t * kTensorSlots;
    TORCH_CHECK(entry[1] >= 0 && entry[1] <= kMaxDims, "torchpp pipeline: corrupt metadata header (ndim ", entry[1], ")");
    meta.tensors.push_back(TensorMeta{static_cast<c10::ScalarType>(entry[0]), {entry + 2, entry + 2 + entry[1]}});
  }
  return meta;
}

MessageMeta MessageMeta::gradients() const {
  MessageMeta grads;
  for (const auto& meta : tensors) {
    if (carries_gradient(meta.dtype)) grads.tensors.push_back(meta);
  }
  return grads;
}

std::string MessageMeta::str() const {
  if (tensors.size() == 1) return tensors[0].str();
  std::string out = "(";
  for (size_t t = 0; t < tensors.size(); t++) out += (t ? ", " : "") + tensors[t].str();
  return out + ")";
}

void check_expected(const MessageMeta& got, const MessageMeta& want, int64_t stage, int64_t microbatch,
                    const std::string& what, const std::string& source, const std::string& given_as) {
  auto same_but_batch = [](const TensorMeta& a, const TensorMeta& b) {
    return a.dtype == b.dtype && a.shape.size() == b.shape.size() &&
           std::equal(a.shape.begin() + std::min<size_t>(1, a.shape.size()), a.shape.end(),
                      b.shape.begin() + std::min<size_t>(1, b.shape.size()));
  };
  if (want.tensors.size() == got.tensors.size() &&
      std::equal(want.tensors.begin(), want.tensors.end(), got.tensors.begin(), same_but_batch)) {
    return;
  }
  throw PipelineFailure(FailureKind::Shape, "PipelineShapeError: stage " + std::to_string(stage) + " microbatch " +
                                                std::to_string(microbatch) + " " + what + " " + got.str() +
                                                (source.empty() ? "" : " " + source) + " but expects " + want.str() +
                                                " (its " + given_as + ")");
}

}  // namespace torchpp::runtime
