#include "runtime/fingerprint.h"

#include <cstring>
#include <limits>
#include <map>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

namespace torchpp::runtime {
namespace {

constexpr int64_t kUnknown = std::numeric_limits<int64_t>::min();
// Bytes of one rank's fingerprint in the exchange that names a disagreement.
constexpr int64_t kExchangeBytes = 4096;
constexpr char kSeparator = '\x1f';

// FNV-1a, kept to 62 bits so that -h never overflows and stays above kUnknown.
int64_t field_hash(const std::string& value) {
  uint64_t hash = 14695981039346656037ull;
  for (unsigned char c : value) {
    hash ^= c;
    hash *= 1099511628211ull;
  }
  return static_cast<int64_t>(hash & ((1ull << 62) - 1));
}

std::vector<std::string> split(const std::string& text) {
  std::vector<std::string> parts(1);
  for (char c : text) {
    if (c == kSeparator) {
      parts.emplace_back();
    } else {
      parts.back() += c;
    }
  }
  return parts;
}

std::string ranks_text(const std::vector<int>& ranks) {
  std::string text = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size(); i++) text += (i ? ", " : "") + std::to_string(ranks[i]);
  return text;
}

}  // namespace

std::vector<int64_t> Fingerprint::vote_slots() const {
  TORCH_CHECK(fields.size() <= kFingerprintFields, "torchpp pipeline: a fingerprint holds at most ", kFingerprintFields,
              " fields, got ", fields.size());
  std::vector<int64_t> slots(kFingerprintSlots, kUnknown);
  for (size_t f = 0; f < fields.size(); f++) {
    if (fields[f].second.empty()) continue;
    const int64_t hash = field_hash(fields[f].second);
    slots[2 * f] = hash;
    slots[2 * f + 1] = -hash;
  }
  return slots;
}

std::vector<size_t> disagreeing_fields(const int64_t* reduced_slots) {
  std::vector<size_t> fields;
  for (size_t f = 0; f < kFingerprintFields; f++) {
    const int64_t most = reduced_slots[2 * f];
    if (most != kUnknown && most != -reduced_slots[2 * f + 1]) fields.push_back(f);
  }
  return fields;
}

std::string disagreement_message(c10d::ProcessGroup& group, const Fingerprint& mine,
                                 const std::vector<size_t>& fields, c10::Device device, const WaitBound& bound) {
  std::string text;
  for (size_t f = 0; f < mine.fields.size(); f++) text += (f ? std::string(1, kSeparator) : "") + mine.fields[f].second;
  text.resize(std::min<int64_t>(text.size(), kExchangeBytes - 1));
  auto buffer = at::zeros({kExchangeBytes}, at::kByte);
  std::memcpy(buffer.data_ptr<uint8_t>(), text.data(), text.size());
  std::vector<at::Tensor> inputs{buffer.to(device)};
  std::vector<std::vector<at::Tensor>> outputs(1);
  for (int r = 0; r < group.getSize(); r++) outputs[0].push_back(at::empty_like(inputs[0]));
  wait_bounded(*group.allgather(outputs, inputs), bound,
               [] { return std::string("every rank's schedule fingerprint (after the step-start vote)"); });
  std::vector<std::vector<std::string>> values;  // per rank, per field
  for (const auto& gathered : outputs[0]) {
    const auto bytes = gathered.cpu();
    values.push_back(split(std::string(reinterpret_cast<const char*>(bytes.data_ptr<uint8_t>()))));
  }
  std::string message = "the ranks of the pipeline group built different schedules (found by the step-start vote, "
                        "before any message):";
  for (size_t f : fields) {
    std::map<std::string, std::vector<int>> by_value;
    for (int r = 0; r < static_cast<int>(values.size()); r++) {
      const std::string value = f < values[r].size() ? values[r][f] : std::string();
      if (!value.empty()) by_value[value].push_back(r);
    }
    const std::string name = f < mine.fields.size() ? mine.fields[f].first : "field " + std::to_string(f);
    message += " " + name + ":";
    bool first = true;
    for (const auto& [value, ranks] : by_value) {
      message += std::string(first ? " " : ", ") + value + " on " + ranks_text(ranks);
      first = false;
    }
    message += ";";
  }
  return message + " build the same schedule (name, n_microbatches and options) on every rank";
}

}  // namespace torchpp::runtime
