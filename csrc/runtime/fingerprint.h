// The schedule fingerprint: what every rank of a pipeline must agree on before any message
// can be matched (schedule name, microbatches, stages, a hash of the lowered action lists,
// parameter dtype, ...). Each field rides in the step-start vote as two slots (h, -h) of its
// hash under the vote's MAX all-reduce: equal on every rank iff max(h) == -max(-h). So every
// step checks it at no extra message, and every rank finds a disagreement at the same vote,
// before its first message; only then do the ranks exchange the values, to name them.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <c10/core/Device.h>

#include "runtime/bounded_wait.h"

namespace c10d {
class ProcessGroup;
}

namespace torchpp::runtime {

constexpr size_t kFingerprintFields = 8;
constexpr size_t kFingerprintSlots = 2 * kFingerprintFields;

struct Fingerprint {
  // (name, value) in a fixed order; an empty value is unknown on this rank and matches anything.
  std::vector<std::pair<std::string, std::string>> fields;

  // kFingerprintSlots int64 (h, -h) per field; unknown or absent fields are neutral (INT64_MIN).
  std::vector<int64_t> vote_slots() const;
};

// The fields whose reduced slots say that ranks disagree.
std::vector<size_t> disagreeing_fields(const int64_t* reduced_slots);

// Exchanges every rank's fingerprint over `group` (all ranks found the same disagreement, so
// all call this) and names each disagreeing field's value on each rank.
std::string disagreement_message(c10d::ProcessGroup& group, const Fingerprint& mine,
                                 const std::vector<size_t>& fields, c10::Device device, const WaitBound& bound);

}  // namespace torchpp::runtime
