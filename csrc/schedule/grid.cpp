#include "schedule/grid.h"

#include <algorithm>
#include <sstream>

namespace torchpp::schedule {

std::string format_grid(const Schedule& s, const std::vector<std::pair<int, int>>& marks,
                        int max_steps) {
  int num_steps = 0;
  for (const auto& row : s.actions) num_steps = std::max(num_steps, static_cast<int>(row.size()));
  int first = 0, last = num_steps;  // window [first, last)
  constexpr int kWindow = 8;        // steps shown either side of an error mark
  if (!marks.empty()) {
    int centre = marks.front().second;
    first = std::max(0, centre - kWindow);
    last = std::min(num_steps, centre + kWindow + 1);
  } else if (max_steps > 0 && num_steps > max_steps) {
    last = max_steps;
  }
  auto marked = [&](int r, int step) {
    return std::find(marks.begin(), marks.end(), std::make_pair(r, step)) != marks.end();
  };
  size_t width = std::to_string(std::max(num_steps - 1, 0)).size();
  std::vector<std::vector<std::string>> cells(s.num_ranks);
  for (int r = 0; r < s.num_ranks; r++) {
    for (int step = first; step < last; step++) {
      std::string cell = step < static_cast<int>(s.actions[r].size()) ? s.actions[r][step].str() : "";
      if (marked(r, step)) cell = ">" + cell + "<";
      width = std::max(width, cell.size());
      cells[r].push_back(cell);
    }
  }
  std::ostringstream out;
  std::string label_pad(std::string("rank ") .size() + std::to_string(s.num_ranks - 1).size(), ' ');
  auto pad = [&](const std::string& text) { return text + std::string(width - text.size(), ' '); };
  out << label_pad << " |" << (first > 0 ? " ..." : "");
  for (int step = first; step < last; step++) out << ' ' << pad(std::to_string(step));
  out << (last < num_steps ? " ..." : "") << '\n';
  for (int r = 0; r < s.num_ranks; r++) {
    std::string label = "rank " + std::to_string(r);
    out << label << std::string(label_pad.size() - label.size(), ' ') << " |"
        << (first > 0 ? "    " : "");
    for (const std::string& cell : cells[r]) out << ' ' << pad(cell);
    bool row_marked = false;
    for (const auto& m : marks) row_marked |= m.first == r;
    out << (row_marked ? "   <-- here" : "") << '\n';
  }
  return out.str();
}

}  // namespace torchpp::schedule
