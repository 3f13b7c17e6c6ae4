#include "schedule/ir.h"

#include <cctype>
#include <stdexcept>

namespace torchpp::schedule {

namespace {
// Longest names first so "SEND_F" is not read as "S" + garbage; order matches the enum.
constexpr ActionType kParseOrder[] = {ActionType::SEND_F, ActionType::RECV_F, ActionType::SEND_B,
                                      ActionType::RECV_B, ActionType::F,      ActionType::I,
                                      ActionType::W,      ActionType::B};
}  // namespace

const char* action_type_name(ActionType type) {
  switch (type) {
    case ActionType::F: return "F";
    case ActionType::I: return "I";
    case ActionType::W: return "W";
    case ActionType::B: return "B";
    case ActionType::SEND_F: return "SEND_F";
    case ActionType::RECV_F: return "RECV_F";
    case ActionType::SEND_B: return "SEND_B";
    case ActionType::RECV_B: return "RECV_B";
  }
  return "?";
}

bool is_compute(ActionType type) {
  return type == ActionType::F || type == ActionType::I || type == ActionType::W ||
         type == ActionType::B;
}

std::string Action::str() const {
  return std::to_string(stage) + action_type_name(type) + std::to_string(microbatch);
}

Action Action::parse(const std::string& raw) {
  size_t begin = raw.find_first_not_of(" \t\r\n");
  size_t end = raw.find_last_not_of(" \t\r\n");
  std::string text = begin == std::string::npos ? "" : raw.substr(begin, end - begin + 1);
  auto fail = [&]() {
    return std::invalid_argument("invalid action string '" + raw +
                                 "': expected <stage><type><microbatch> such as 0F3, 1I0, "
                                 "2W5, 3B1, 1SEND_F3, 2RECV_B0");
  };
  size_t digits = 0;
  while (digits < text.size() && std::isdigit(static_cast<unsigned char>(text[digits]))) digits++;
  if (digits == 0 || digits > 9) throw fail();
  for (ActionType type : kParseOrder) {
    std::string name = action_type_name(type);
    if (text.compare(digits, name.size(), name) != 0) continue;
    std::string tail = text.substr(digits + name.size());
    if (tail.empty() || tail.size() > 9) throw fail();
    for (char ch : tail) {
      if (!std::isdigit(static_cast<unsigned char>(ch))) throw fail();
    }
    return Action{std::stoi(text.substr(0, digits)), type, std::stoi(tail)};
  }
  throw fail();
}

std::vector<int> Schedule::stages_of_rank(int rank) const {
  std::vector<int> stages;
  for (int s = 0; s < num_stages; s++) {
    if (stage_to_rank[s] == rank) stages.push_back(s);
  }
  return stages;
}

std::vector<std::string> Schedule::action_strings(int rank) const {
  if (rank < 0 || rank >= num_ranks) {
    throw std::out_of_range("rank " + std::to_string(rank) + " out of range [0, " +
                            std::to_string(num_ranks) + ")");
  }
  std::vector<std::string> out;
  out.reserve(actions[rank].size());
  for (const Action& a : actions[rank]) out.push_back(a.str());
  return out;
}

Schedule make_schedule(std::string name, int num_ranks, int num_microbatches,
                       std::vector<int> stage_to_rank, int num_pipelines) {
  Schedule s;
  s.name = std::move(name);
  s.num_ranks = num_ranks;
  s.num_stages = static_cast<int>(stage_to_rank.size());
  s.num_microbatches = num_microbatches;
  s.num_pipelines = num_pipelines;
  s.stage_to_rank = std::move(stage_to_rank);
  s.actions.assign(num_ranks, {});
  return s;
}

}  // namespace torchpp::schedule
