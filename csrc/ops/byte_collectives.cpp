#include "ops/byte_collectives.h"

#include <algorithm>
#include <cstring>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "ops/process_group.h"

namespace torchpp {

namespace {

at::Tensor bytes_tensor(const std::string& bytes, int64_t length, c10::Device device) {
  auto host = at::zeros({length}, at::TensorOptions().dtype(at::kByte));
  std::memcpy(host.data_ptr(), bytes.data(), std::min<int64_t>(length, bytes.size()));
  return host.to(device);
}

std::string tensor_bytes(const at::Tensor& tensor, int64_t length) {
  auto host = tensor.cpu().contiguous();
  return std::string(static_cast<const char*>(host.data_ptr()), length);
}

int64_t to_length(const at::Tensor& size) { return size.cpu().item<int64_t>(); }

}  // namespace

std::vector<std::string> all_gather_bytes(const std::string& group_name, const std::string& mine,
                                          c10::Device device) {
  auto group = resolve_group(group_name);
  const int64_t ranks = group->getSize();
  // Lengths first: every rank's buffer is padded to the longest.
  std::vector<at::Tensor> length_in{at::full({1}, static_cast<int64_t>(mine.size()), at::kLong).to(device)};
  std::vector<std::vector<at::Tensor>> length_out(1);
  for (int64_t r = 0; r < ranks; ++r) length_out[0].push_back(at::empty_like(length_in[0]));
  group->allgather(length_out, length_in)->wait();
  std::vector<int64_t> lengths;
  for (const auto& length : length_out[0]) lengths.push_back(to_length(length));
  const int64_t longest = *std::max_element(lengths.begin(), lengths.end());

  std::vector<at::Tensor> data_in{bytes_tensor(mine, longest, device)};
  std::vector<std::vector<at::Tensor>> data_out(1);
  for (int64_t r = 0; r < ranks; ++r) data_out[0].push_back(at::empty_like(data_in[0]));
  group->allgather(data_out, data_in)->wait();
  std::vector<std::string> gathered;
  for (int64_t r = 0; r < ranks; ++r) gathered.push_back(tensor_bytes(data_out[0][r], lengths[r]));
  return gathered;
}

std::string broadcast_bytes(const std::string& group_name, int64_t src, const std::string& mine, c10::Device device) {
  auto group = resolve_group(group_name);
  TORCH_CHECK(0 <= src && src < group->getSize(), "torchpp.broadcast_bytes: source group rank ", src,
              " is not in group '", group_name, "' of ", group->getSize(), " ranks");
  c10d::BroadcastOptions options;
  options.rootRank = src;
  std::vector<at::Tensor> length{at::full({1}, static_cast<int64_t>(mine.size()), at::kLong).to(device)};
  group->broadcast(length, options)->wait();
  const int64_t bytes = to_length(length[0]);
  std::vector<at::Tensor> data{bytes_tensor(mine, bytes, device)};
  group->broadcast(data, options)->wait();
  return tensor_bytes(data[0], bytes);
}

}  // namespace torchpp
