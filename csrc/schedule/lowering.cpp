#include "schedule/lowering.h"

#include <algorithm>
#include <deque>
#include <unordered_set>

#include "schedule/dependencies.h"
#include "schedule/errors.h"
#include "schedule/grid.h"

namespace torchpp::schedule {

namespace {

int64_t recv_key(const Schedule& s, const Action& recv) {
  return (static_cast<int64_t>(recv.stage) * s.num_microbatches + recv.microbatch) * 2 +
         (recv.type == ActionType::RECV_B);
}

}  // namespace

Schedule compute_only(const Schedule& s) {
  Schedule out = s;
  out.lowered = false;
  for (auto& row : out.actions) {
    std::vector<Action> kept;
    kept.reserve(row.size());
    for (const Action& a : row) {
      if (is_compute(a.type)) kept.push_back(a);
    }
    row = std::move(kept);
  }
  return out;
}

Schedule forward_only(const Schedule& s) {
  Schedule out = compute_only(s);
  for (auto& row : out.actions) {
    row.erase(std::remove_if(row.begin(), row.end(), [](const Action& a) { return a.type != ActionType::F; }),
              row.end());
  }
  return out;
}

Schedule lower(const Schedule& s) {
  if (s.lowered) return s;
  const int p = s.num_ranks;
  // fifo[src][dst]: the RECVs dst must post, in the order src sends.
  std::vector<std::vector<std::deque<Action>>> fifo(p, std::vector<std::deque<Action>>(p));
  Schedule with_sends = s;
  with_sends.lowered = true;
  for (int r = 0; r < p; r++) {
    auto& row = with_sends.actions[r];
    row.clear();
    for (const Action& a : s.actions[r]) {
      row.push_back(a);
      int next = s.next_stage(a.stage), prev = s.prev_stage(a.stage);
      if (a.type == ActionType::F && next >= 0 && s.stage_to_rank[next] != r) {
        row.push_back({a.stage, ActionType::SEND_F, a.microbatch});
        fifo[r][s.stage_to_rank[next]].push_back({next, ActionType::RECV_F, a.microbatch});
      } else if ((a.type == ActionType::I || a.type == ActionType::B) && prev >= 0 &&
                 s.stage_to_rank[prev] != r) {
        row.push_back({a.stage, ActionType::SEND_B, a.microbatch});
        fifo[r][s.stage_to_rank[prev]].push_back({prev, ActionType::RECV_B, a.microbatch});
      }
    }
  }
  Schedule out = with_sends;
  for (int r = 0; r < p; r++) {
    std::vector<Action> merged;
    merged.reserve(with_sends.actions[r].size() * 2);
    std::unordered_set<int64_t> posted;
    int step = 0;
    for (const Action& a : with_sends.actions[r]) {
      Action recv;
      int src = -1;
      if (is_compute(a.type) && needed_recv(s, r, a, recv, src) && !posted.count(recv_key(s, recv))) {
        auto& queue = fifo[src][r];
        bool found = false;
        while (!queue.empty() && !found) {
          Action head = queue.front();
          queue.pop_front();
          merged.push_back(head);
          posted.insert(recv_key(s, head));
          found = head == recv;
        }
        if (!found) {
          throw ScheduleError("cannot lower schedule '" + s.name + "': rank " + std::to_string(r) +
                              " step " + std::to_string(step) + " " + a.str() +
                              " needs " + recv.str() + " but rank " + std::to_string(src) +
                              " never sends it\n" + format_grid(s, {{r, step}}));
        }
      }
      merged.push_back(a);
      if (is_compute(a.type)) step++;
    }
    out.actions[r] = std::move(merged);
  }
  for (int src = 0; src < p; src++) {
    for (int dst = 0; dst < p; dst++) {
      if (!fifo[src][dst].empty()) {
        throw ScheduleError("cannot lower schedule '" + s.name + "': rank " + std::to_string(src) +
                            " sends " + fifo[src][dst].front().str() + " to rank " +
                            std::to_string(dst) + " which never consumes it");
      }
    }
  }
  return out;
}

}  // namespace torchpp::schedule
