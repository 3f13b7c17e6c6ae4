#include "ops/byte_collectives.h"

#include <algorithm>
#include <cstring>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "ops/c10d_compat.h"
#include "ops/process_group.h"

namespace torchpp {

namespace {

at::Tensor bytes_tensor(const std::string& bytes, int64_t length, c10::Device device) {
  auto host = at::zeros({length}, at::TensorOptions().dtype(at::kByte));
  std::memcpy(host.data_ptr(), bytes.data(), std::min<int64_t>(length, bytes.size()));
  return host.to(device);
}

std::string tensor_bytes(const at::Tensor& host, int64_t length) {
  return std::string(static_cast<const char*>(host.data_ptr()), length);
}

// Every rank's `local` (contiguous, the same shape everywhere) as rows of one [ranks, numel] tensor on the host.
at::Tensor gather_rows(c10d::ProcessGroup& group, const at::Tensor& local) {
  auto gathered = at::empty({group.getSize() * local.numel()}, local.options());
  auto input = local.view({-1});
  c10d_compat::all_gather_single(group, gathered, input)->wait();
  return gathered.view({group.getSize(), local.numel()}).cpu();
}

}  // namespace

std::vector<std::string> all_gather_bytes(const std::string& group_name, const std::string& mine,
                                          c10::Device device) {
  auto group = resolve_group(group_name);
  // Lengths first: every rank's buffer is padded to the longest.
  const auto lengths =
      gather_rows(*group, at::full({1}, static_cast<int64_t>(mine.size()), at::kLong).to(device)).view({-1});
  const auto data = gather_rows(*group, bytes_tensor(mine, lengths.max().item<int64_t>(), device));
  std::vector<std::string> gathered;
  for (int64_t r = 0; r < group->getSize(); ++r) {
    gathered.push_back(tensor_bytes(data[r], lengths[r].item<int64_t>()));
  }
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
  const int64_t bytes = length[0].cpu().item<int64_t>();
  std::vector<at::Tensor> data{bytes_tensor(mine, bytes, device)};
  group->broadcast(data, options)->wait();
  return tensor_bytes(data[0].cpu(), bytes);
}

}  // namespace torchpp
