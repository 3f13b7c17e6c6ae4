#include "schedule/in_order_p2p.h"

#include <algorithm>
#include <map>
#include <tuple>

#include "schedule/dependencies.h"
#include "schedule/errors.h"
#include "schedule/grid.h"
#include "schedule/lowering.h"
#include "schedule/simulator.h"

namespace torchpp::schedule {

namespace {

// The message a SEND or RECV action moves: (consuming stage, microbatch, gradient?).
using Message = std::tuple<int, int, bool>;

Message message_of(const Action& a) {
  switch (a.type) {
    case ActionType::SEND_F: return {a.stage + 1, a.microbatch, false};
    case ActionType::RECV_F: return {a.stage, a.microbatch, false};
    case ActionType::SEND_B: return {a.stage - 1, a.microbatch, true};
    default: return {a.stage, a.microbatch, true};
  }
}

bool is_send(ActionType t) { return t == ActionType::SEND_F || t == ActionType::SEND_B; }

}  // namespace

Schedule lower_in_order(const Schedule& s) {
  Schedule compute = compute_only(s);
  const Simulation sim = simulate(compute, Costs{});
  // Sort key per rank: (time, 0 for messages / 1 for compute, tie-break). Messages sharing a
  // send time are ordered by (source rank, message) on both of their ranks alike.
  using Key = std::tuple<double, int, int, Message, int>;
  std::vector<std::vector<std::pair<Key, Action>>> items(s.num_ranks);
  for (int r = 0; r < s.num_ranks; r++) {
    int index = 0;
    for (const TimedAction& t : sim.timeline[r]) {
      items[r].push_back({Key{t.start, 1, 0, Message{}, index++}, t.action});
    }
  }
  for (const Transfer& x : sim.transfers) {
    const bool gradient = x.producer.type != ActionType::F;
    const Action send{x.producer.stage, gradient ? ActionType::SEND_B : ActionType::SEND_F, x.producer.microbatch};
    const Action recv{x.consumer.stage, gradient ? ActionType::RECV_B : ActionType::RECV_F, x.consumer.microbatch};
    const Message message = message_of(send);
    items[x.src_rank].push_back({Key{x.send_time, 0, x.src_rank, message, 0}, send});
    items[x.dst_rank].push_back({Key{x.send_time, 0, x.src_rank, message, 0}, recv});
  }
  Schedule out = compute;
  out.lowered = true;
  for (int r = 0; r < s.num_ranks; r++) {
    std::stable_sort(items[r].begin(), items[r].end(),
                     [](const auto& a, const auto& b) { return a.first < b.first; });
    out.actions[r].clear();
    for (const auto& item : items[r]) out.actions[r].push_back(item.second);
  }
  return out;
}

void check_in_order_p2p(const Schedule& s) {
  if (!s.lowered) throw ScheduleError("check_in_order_p2p needs a lowered schedule, got '" + s.name + "'");
  const int p = s.num_ranks;
  // Per rank: compute actions with the index of the communication op holding their input, and
  // communication ops with the number of compute actions issued before them.
  struct Compute { Action action; int needs_op; };
  struct Comm { Action action; Message message; int computes_before; };
  std::vector<std::vector<Compute>> computes(p);
  std::vector<std::vector<Comm>> comms(p);
  for (int r = 0; r < p; r++) {
    std::map<Message, int> recv_op;
    for (const Action& a : s.actions[r]) {
      if (is_compute(a.type)) {
        Action recv;
        int src = -1, op = -1;
        if (needed_recv(s, r, a, recv, src)) {
          auto it = recv_op.find(message_of(recv));
          if (it == recv_op.end()) throw ScheduleError("schedule '" + s.name + "': " + a.str() + " on rank " +
                                                       std::to_string(r) + " has no RECV before it");
          op = it->second;
        }
        computes[r].push_back({a, op});
      } else {
        const Message message = message_of(a);
        if (!is_send(a.type)) recv_op[message] = static_cast<int>(comms[r].size());
        comms[r].push_back({a, message, static_cast<int>(computes[r].size())});
      }
    }
  }
  std::vector<size_t> next_compute(p, 0), next_comm(p, 0);
  for (;;) {
    bool progressed = false;
    for (int r = 0; r < p; r++) {
      while (next_compute[r] < computes[r].size() &&
             computes[r][next_compute[r]].needs_op < static_cast<int>(next_comm[r])) {
        next_compute[r]++;
        progressed = true;
      }
    }
    // The communication op at the front of each rank's stream, if it may start.
    std::map<std::pair<Message, bool>, int> started;  // (message, send?) -> rank
    for (int r = 0; r < p; r++) {
      if (next_comm[r] < comms[r].size() && comms[r][next_comm[r]].computes_before <= static_cast<int>(next_compute[r])) {
        const Comm& op = comms[r][next_comm[r]];
        started[{op.message, is_send(op.action.type)}] = r;
      }
    }
    for (const auto& [key, rank] : started) {
      if (key.second && started.count({key.first, false})) {
        next_comm[rank]++;
        next_comm[started.at({key.first, false})]++;
        progressed = true;
      }
    }
    bool finished = true;
    for (int r = 0; r < p; r++) finished = finished && next_compute[r] == computes[r].size() && next_comm[r] == comms[r].size();
    if (finished) return;
    if (!progressed) {
      std::string stuck;
      std::vector<std::pair<int, int>> marks;
      for (int r = 0; r < p; r++) {
        if (next_comm[r] < comms[r].size()) {
          stuck += "\n  rank " + std::to_string(r) + " waits on " + comms[r][next_comm[r]].action.str();
          marks.emplace_back(r, static_cast<int>(next_compute[r]));
        }
      }
      throw ScheduleError("schedule '" + s.name + "' deadlocks on an in-order transport (NCCL):" + stuck + "\n" +
                          format_grid(compute_only(s), marks, 48));
    }
  }
}

}  // namespace torchpp::schedule
