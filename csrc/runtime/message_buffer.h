// The wire form of one pipeline message: a flat buffer, so a message is one send whatever the
// number of tensors in it. A lone tensor travels as itself, flattened (no copy when it is
// contiguous); several are packed into one byte buffer, each at a 16-byte-aligned offset so it
// can be viewed back as its dtype without a copy.
#pragma once

#include <ATen/core/Tensor.h>

#include "runtime/tensor_meta.h"

namespace torchpp::runtime {

// Elements of the wire buffer of a message of `meta`.
int64_t wire_numel(const MessageMeta& meta);
c10::ScalarType wire_dtype(const MessageMeta& meta);

// The buffer to send: a lone tensor itself (not flattened: sending flattens it), or the packed bytes.
at::Tensor pack_message(const Tensors& tensors);
// The message's tensors, viewing `wire` (a flat buffer of wire_numel(meta) elements).
Tensors unpack_message(const at::Tensor& wire, const MessageMeta& meta);

}  // namespace torchpp::runtime
