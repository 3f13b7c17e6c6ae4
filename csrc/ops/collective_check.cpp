#include "ops/collective_check.h"

#include <atomic>
#include <cstdlib>
#include <cstring>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

namespace torchpp {
namespace {

constexpr int64_t kDescribedDims = 13;  // dims of a shape named in the message
constexpr int64_t kDescriptionSlots = 3 + kDescribedDims;  // kind, dtype, ndim, dims

std::atomic<bool>& enabled() {
  static std::atomic<bool> flag([] {
    const char* value = std::getenv("TORCHPP_COLLECTIVE_CHECKS");
    return value == nullptr || std::strcmp(value, "0") != 0;
  }());
  return flag;
}

// FNV-1a over the kind, dtype and shape, kept to 62 bits so that -h cannot overflow.
int64_t signature(CollectiveKind kind, const at::Tensor& input) {
  uint64_t hash = 14695981039346656037ull;
  auto mix = [&](int64_t value) {
    hash ^= static_cast<uint64_t>(value);
    hash *= 1099511628211ull;
  };
  mix(static_cast<int64_t>(kind));
  mix(static_cast<int64_t>(input.scalar_type()));
  mix(input.dim());
  for (int64_t size : input.sizes()) mix(size);
  return static_cast<int64_t>(hash & ((1ull << 62) - 1));
}

const char* kind_name(int64_t kind) {
  switch (static_cast<CollectiveKind>(kind)) {
    case CollectiveKind::AllReduce:
      return "all-reduce";
    case CollectiveKind::AllGather:
      return "all-gather";
    case CollectiveKind::ReduceScatter:
      return "reduce-scatter";
    case CollectiveKind::AllToAll:
      return "all-to-all";
  }
  return "collective";
}

// "all-reduce of [4, 8] Float"
std::string describe(const int64_t* slots) {
  std::string text = std::string(kind_name(slots[0])) + " of [";
  const int64_t ndim = slots[2];
  for (int64_t d = 0; d < std::min(ndim, kDescribedDims); d++) text += (d ? ", " : "") + std::to_string(slots[3 + d]);
  if (ndim > kDescribedDims) text += ", ...";
  return text + "] " + c10::toString(static_cast<c10::ScalarType>(slots[1]));
}

[[noreturn]] void report_mismatch(c10d::ProcessGroup& group, const std::string& group_name, const at::Tensor& input,
                                  CollectiveKind kind, const char* op_name) {
  auto mine = at::zeros({kDescriptionSlots}, at::kLong);
  auto* slots = mine.data_ptr<int64_t>();
  slots[0] = static_cast<int64_t>(kind);
  slots[1] = static_cast<int64_t>(input.scalar_type());
  slots[2] = input.dim();
  for (int64_t d = 0; d < std::min<int64_t>(input.dim(), kDescribedDims); d++) slots[3 + d] = input.size(d);
  std::vector<at::Tensor> inputs{mine.to(input.device())};
  std::vector<std::vector<at::Tensor>> outputs(1);
  for (int r = 0; r < group.getSize(); r++) outputs[0].push_back(at::empty_like(inputs[0]));
  group.allgather(outputs, inputs)->wait();
  std::string ranks;
  for (int r = 0; r < group.getSize(); r++) {
    const auto theirs = outputs[0][r].cpu();
    ranks += (r ? ", " : "") + describe(theirs.data_ptr<int64_t>()) + " on rank " + std::to_string(r);
  }
  TORCH_CHECK(false, "torchpp.", op_name, ": the ranks of group '", group_name,
              "' passed different tensors to one collective (checked before it, since gloo would abort the "
              "process): ", ranks, "; every rank of the group must pass the same shape and dtype");
}

}  // namespace

bool collective_checks() { return enabled().load(std::memory_order_relaxed); }

void set_collective_checks(bool value) { enabled().store(value); }

void check_same_input(c10d::ProcessGroup& group, const std::string& group_name, const at::Tensor& input,
                      CollectiveKind kind, const char* op_name) {
  if (!collective_checks() || group.getSize() < 2) return;
  if (group.getBackend(input.device().type())->getBackendName() != "gloo") return;
  const int64_t hash = signature(kind, input);
  // MAX of (h, -h) over ranks: max(h) == min(h) iff every rank has the same signature.
  std::vector<at::Tensor> votes{at::tensor({hash, -hash}, at::TensorOptions().dtype(at::kLong)).to(input.device())};
  c10d::AllreduceOptions options;
  options.reduceOp = c10d::ReduceOp::MAX;
  group.allreduce(votes, options)->wait();
  const auto reduced = votes[0].cpu();
  const auto* v = reduced.data_ptr<int64_t>();
  if (v[0] != -v[1]) report_mismatch(group, group_name, input, kind, op_name);
}

}  // namespace torchpp
