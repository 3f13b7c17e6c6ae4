// Megatron's scatter/gather optimization of pipeline P2P under tensor parallelism: a stage
// output is replicated over the TP group, so each TP rank ships only its 1/t slice to its peer
// in the next stage, and the receivers all-gather the slices inside their TP group.
#pragma once

#include <chrono>
#include <string>

#include <ATen/core/Tensor.h>

namespace torchpp::p2p {

// Elements each TP rank sends for a tensor of `numel` elements: numel / tp_size when it
// divides, else the whole tensor (the fallback).
int64_t sent_numel(int64_t numel, int64_t tp_size);

// This TP rank's flat slice of `full` (or all of it, flattened, when the size does not divide).
at::Tensor scatter_slice(const at::Tensor& full, int64_t tp_rank, int64_t tp_size);

// Rebuilds the tensor of `shape` from this rank's received slice: all-gathers over the TP
// group when the tensor was sliced, otherwise only reshapes. `timeout`: how long the
// all-gather may wait (zero: the group's own timeout).
at::Tensor gather_slices(const at::Tensor& slice, c10::IntArrayRef shape, const std::string& tp_group_name,
                         int64_t tp_size, std::chrono::milliseconds timeout = std::chrono::milliseconds(0));

}  // namespace torchpp::p2p
