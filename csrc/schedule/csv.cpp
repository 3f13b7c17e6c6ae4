#include "schedule/csv.h"

#include <algorithm>
#include <sstream>
#include <stdexcept>

namespace torchpp::schedule {

std::string to_csv(const Schedule& s) {
  std::string out;
  for (const auto& row : s.actions) {
    for (size_t k = 0; k < row.size(); k++) out += (k ? "," : "") + row[k].str();
    out += "\r\n";  // what Python's csv.writer ends rows with
  }
  return out;
}

Schedule from_csv(const std::string& text, int num_ranks, int num_microbatches, int num_pipelines) {
  if (num_ranks < 1 || num_microbatches < 1) {
    throw std::invalid_argument("from_csv: num_ranks and num_microbatches must be >= 1 (got " +
                                std::to_string(num_ranks) + ", " + std::to_string(num_microbatches) + ")");
  }
  std::vector<std::vector<Action>> rows;
  std::istringstream lines(text);
  std::string line;
  while (std::getline(lines, line)) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    std::vector<Action> row;
    std::istringstream cells(line);
    std::string cell;
    while (std::getline(cells, cell, ',')) {
      if (cell.find_first_not_of(" \t\"") == std::string::npos) continue;
      row.push_back(Action::parse(cell));
    }
    rows.push_back(std::move(row));
  }
  while (!rows.empty() && rows.back().empty() && static_cast<int>(rows.size()) > num_ranks) rows.pop_back();
  if (static_cast<int>(rows.size()) > num_ranks) {
    throw std::invalid_argument("from_csv: " + std::to_string(rows.size()) + " rows for num_ranks=" +
                                std::to_string(num_ranks));
  }
  rows.resize(num_ranks);
  int num_stages = 0;
  bool lowered = false;
  for (const auto& row : rows) {
    for (const Action& a : row) {
      num_stages = std::max(num_stages, a.stage + 1);
      lowered |= !is_compute(a.type);
    }
  }
  std::vector<int> placement(num_stages, -1);
  for (int r = 0; r < num_ranks; r++) {
    for (const Action& a : rows[r]) {
      if (placement[a.stage] >= 0 && placement[a.stage] != r) {
        throw std::invalid_argument("from_csv: stage " + std::to_string(a.stage) + " has actions on ranks " +
                                    std::to_string(placement[a.stage]) + " and " + std::to_string(r) +
                                    " (a stage lives on exactly one rank)");
      }
      placement[a.stage] = r;
    }
  }
  for (int st = 0; st < num_stages; st++) {
    if (placement[st] < 0) throw std::invalid_argument("from_csv: stage " + std::to_string(st) + " has no action");
  }
  if (num_pipelines == 0) {
    num_pipelines = 1;
    bool first_half_only = num_stages % 2 == 0 && num_microbatches % 2 == 0;
    for (const Action& a : rows[placement.empty() ? 0 : placement[0]]) {
      if (a.stage == 0 && a.microbatch >= num_microbatches / 2) first_half_only = false;
    }
    if (first_half_only && num_stages > 0) num_pipelines = 2;
  }
  Schedule s = make_schedule("csv", num_ranks, num_microbatches, placement, num_pipelines);
  s.actions = std::move(rows);
  s.lowered = lowered;
  return s;
}

}  // namespace torchpp::schedule
