#include "runtime/message_buffer.h"

#include <ATen/ATen.h>

namespace torchpp::runtime {
namespace {

// Covers the widest element (complex128), so every packed tensor can be viewed as its dtype.
constexpr int64_t kAlignment = 16;

int64_t aligned(int64_t bytes) { return (bytes + kAlignment - 1) / kAlignment * kAlignment; }

int64_t nbytes(const TensorMeta& meta) { return meta.numel() * static_cast<int64_t>(c10::elementSize(meta.dtype)); }

}  // namespace

int64_t wire_numel(const MessageMeta& meta) {
  if (meta.tensors.size() == 1) return meta.tensors[0].numel();
  int64_t total = 0;
  for (const auto& tensor : meta.tensors) total += aligned(nbytes(tensor));
  return total;
}

c10::ScalarType wire_dtype(const MessageMeta& meta) {
  return meta.tensors.size() == 1 ? meta.tensors[0].dtype : at::kByte;
}

at::Tensor pack_message(const Tensors& tensors) {
  if (tensors.size() == 1) return tensors[0].detach();  // the channel flattens it as it slices
  const MessageMeta meta = MessageMeta::of(tensors);
  auto wire = at::empty({wire_numel(meta)}, tensors.at(0).options().dtype(at::kByte));
  int64_t offset = 0;
  for (size_t t = 0; t < tensors.size(); t++) {
    const int64_t bytes = nbytes(meta.tensors[t]);
    if (bytes > 0) {
      wire.narrow(0, offset, bytes).copy_(tensors[t].detach().contiguous().view({-1}).view(at::kByte));
    }
    offset += aligned(bytes);
  }
  return wire;
}

Tensors unpack_message(const at::Tensor& wire, const MessageMeta& meta) {
  TORCH_CHECK(wire.numel() == wire_numel(meta), "torchpp pipeline: a message buffer of ", wire.numel(),
              " elements does not hold ", meta.str());
  if (meta.tensors.size() == 1) return {wire.view(meta.tensors[0].shape)};
  Tensors tensors;
  int64_t offset = 0;
  for (const auto& tensor : meta.tensors) {
    const int64_t bytes = nbytes(tensor);
    if (bytes == 0) {
      tensors.push_back(at::empty(tensor.shape, wire.options().dtype(tensor.dtype)));
    } else {
      tensors.push_back(wire.narrow(0, offset, bytes).view(tensor.dtype).view(tensor.shape));
    }
    offset += aligned(bytes);
  }
  return tensors;
}

}  // namespace torchpp::runtime
