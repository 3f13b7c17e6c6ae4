// Out-of-place collectives along a tensor dimension, the building blocks of the TP/SP mappings.
// Each returns a new tensor and never modifies its input (custom ops may not alias or mutate inputs).
// Over gloo, each first checks that every rank passes the same shape (collective_check.h).
#pragma once

#include <chrono>
#include <string>

#include <ATen/core/Tensor.h>

namespace torchpp {

// Resolves the group and checks it can serve the tensor's device, without communicating.
void check_group(const at::Tensor& input, const std::string& group_name, const char* op_name);

at::Tensor all_reduce_sum(const at::Tensor& input, const std::string& group_name, const char* op_name);

// Concatenates every rank's `input` along `dim` in rank order; `timeout`: how long to wait for
// the peers (zero: the group's own timeout).
at::Tensor all_gather_along(
    const at::Tensor& input, int64_t dim, const std::string& group_name, int64_t group_size, const char* op_name,
    std::chrono::milliseconds timeout = std::chrono::milliseconds(0));

// Sums over ranks, then keeps this rank's 1/group_size slice along `dim`.
at::Tensor reduce_scatter_along(
    const at::Tensor& input, int64_t dim, const std::string& group_name, int64_t group_size, const char* op_name);

// Keeps this rank's 1/group_size slice along `dim` (no communication).
at::Tensor split_along(
    const at::Tensor& input, int64_t dim, const std::string& group_name, int64_t group_size, const char* op_name);

// Size of `dim` divided by group_size; raises naming the values when it does not divide.
int64_t shard_size(const at::Tensor& input, int64_t dim, int64_t group_size, const char* op_name);

} // namespace torchpp
