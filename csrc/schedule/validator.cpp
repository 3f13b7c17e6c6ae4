#include "schedule/validator.h"

#include <map>
#include <sstream>
#include <tuple>

#include "schedule/dependencies.h"
#include "schedule/errors.h"
#include "schedule/grid.h"
#include "schedule/simulator.h"

namespace torchpp::schedule {

namespace {

[[noreturn]] void fail(const Schedule& s, const std::string& what, int rank = -1, int step = -1) {
  std::string where = rank >= 0 ? " (rank " + std::to_string(rank) + ", step " + std::to_string(step) + ")" : "";
  std::vector<std::pair<int, int>> marks;
  if (rank >= 0) marks.emplace_back(rank, step);
  throw ScheduleError("invalid schedule '" + s.name + "': " + what + where + "\n" +
                      format_grid(s, marks, 48));
}

std::string str(int v) { return std::to_string(v); }

void check_shape(const Schedule& s) {
  if (s.num_ranks < 1 || static_cast<int>(s.actions.size()) != s.num_ranks)
    fail(s, "num_ranks=" + str(s.num_ranks) + " but " + str(s.actions.size()) + " action lists");
  if (s.num_microbatches < 1) fail(s, "num_microbatches must be >= 1, got " + str(s.num_microbatches));
  if (s.num_pipelines < 1 || s.num_stages < s.num_pipelines || s.num_stages % s.num_pipelines)
    fail(s, "num_stages=" + str(s.num_stages) + " must be a positive multiple of num_pipelines=" + str(s.num_pipelines));
  if (static_cast<int>(s.stage_to_rank.size()) != s.num_stages)
    fail(s, "stage_to_rank has " + str(s.stage_to_rank.size()) + " entries for " + str(s.num_stages) + " stages");
  for (int st = 0; st < s.num_stages; st++) {
    if (s.stage_to_rank[st] < 0 || s.stage_to_rank[st] >= s.num_ranks)
      fail(s, "stage " + str(st) + " placed on rank " + str(s.stage_to_rank[st]) + " of " + str(s.num_ranks));
  }
}

// Counts and per-rank order of the compute actions; returns nothing, throws on the first error.
void check_compute(const Schedule& s) {
  const PassIndex index{s.num_microbatches, s.num_stages};
  // position of F, I/B and W of each (stage, mb) on its rank; B also records a W position.
  std::vector<int> position(index.size(), -1);
  std::vector<int> count_b(s.num_stages * s.num_microbatches, 0);
  for (int r = 0; r < s.num_ranks; r++) {
    int step = 0;
    for (const Action& a : s.actions[r]) {
      if (a.stage < 0 || a.stage >= s.num_stages) fail(s, a.str() + " names a stage outside [0, " + str(s.num_stages) + ")", r, step);
      int pipe = s.pipeline_of_stage(a.stage);
      if (a.microbatch < s.microbatch_begin(pipe) || a.microbatch >= s.microbatch_end(pipe))
        fail(s, a.str() + ": pipeline " + str(pipe) + " carries microbatches [" + str(s.microbatch_begin(pipe)) + ", " + str(s.microbatch_end(pipe)) + ")", r, step);
      if (s.stage_to_rank[a.stage] != r)
        fail(s, a.str() + " runs on rank " + str(r) + " but stage " + str(a.stage) + " lives on rank " + str(s.stage_to_rank[a.stage]), r, step);
      if (!is_compute(a.type)) { step++; continue; }
      Pass pass = pass_of(a.type);
      int key = index.key(a.stage, a.microbatch, pass);
      if (position[key] >= 0) fail(s, a.str() + " is scheduled twice (also at step " + str(position[key]) + ")", r, step);
      position[key] = step;
      if (a.type == ActionType::B) {
        int wkey = index.key(a.stage, a.microbatch, Pass::WeightGrad);
        if (position[wkey] >= 0) fail(s, a.str() + " and a W of the same microbatch both compute weight gradients", r, step);
        position[wkey] = step;
        count_b[a.stage * s.num_microbatches + a.microbatch]++;
      }
      int fpos = position[index.key(a.stage, a.microbatch, Pass::Forward)];
      if ((a.type == ActionType::I || a.type == ActionType::B) && fpos < 0)
        fail(s, a.str() + " runs before its forward " + Action{a.stage, ActionType::F, a.microbatch}.str(), r, step);
      if (a.type == ActionType::W) {
        if (position[index.key(a.stage, a.microbatch, Pass::InputGrad)] < 0)
          fail(s, a.str() + " runs before its input-gradient pass " + Action{a.stage, ActionType::I, a.microbatch}.str(), r, step);
        if (count_b[a.stage * s.num_microbatches + a.microbatch])
          fail(s, a.str() + " follows a fused B of the same microbatch", r, step);
      }
      step++;
    }
  }
  for (int st = 0; st < s.num_stages; st++) {
    int pipe = s.pipeline_of_stage(st);
    for (int mb = s.microbatch_begin(pipe); mb < s.microbatch_end(pipe); mb++) {
      for (Pass pass : {Pass::Forward, Pass::InputGrad, Pass::WeightGrad}) {
        if (position[index.key(st, mb, pass)] >= 0) continue;
        static const char* kName[] = {"F", "I or B", "W"};
        fail(s, "stage " + str(st) + " microbatch " + str(mb) + " has no " + kName[static_cast<int>(pass)] +
                    " (each stage must run every microbatch of its pipeline once)");
      }
    }
  }
}

// SEND/RECV placement and FIFO matching of a lowered schedule.
void check_comms(const Schedule& s) {
  using Msg = std::tuple<int, int, int>;  // consumer stage, direction (0 fwd, 1 bwd), microbatch
  std::map<std::pair<int, int>, std::vector<std::pair<Msg, int>>> sends, recvs;  // (src,dst) -> (msg, step)
  for (int r = 0; r < s.num_ranks; r++) {
    std::map<Msg, bool> produced;  // compute passes seen so far on this rank, keyed like messages
    std::map<Msg, bool> received;
    for (int step = 0; step < static_cast<int>(s.actions[r].size()); step++) {
      const Action& a = s.actions[r][step];
      int next = s.next_stage(a.stage), prev = s.prev_stage(a.stage);
      switch (a.type) {
        case ActionType::SEND_F:
          if (next < 0 || s.stage_to_rank[next] == r) fail(s, a.str() + ": stage " + str(a.stage) + " has no successor on another rank", r, step);
          if (!produced.count({a.stage, 0, a.microbatch})) fail(s, a.str() + " precedes its forward", r, step);
          sends[{r, s.stage_to_rank[next]}].push_back({{next, 0, a.microbatch}, step});
          break;
        case ActionType::SEND_B:
          if (prev < 0 || s.stage_to_rank[prev] == r) fail(s, a.str() + ": stage " + str(a.stage) + " has no predecessor on another rank", r, step);
          if (!produced.count({a.stage, 1, a.microbatch})) fail(s, a.str() + " precedes its backward", r, step);
          sends[{r, s.stage_to_rank[prev]}].push_back({{prev, 1, a.microbatch}, step});
          break;
        case ActionType::RECV_F:
          if (prev < 0 || s.stage_to_rank[prev] == r) fail(s, a.str() + ": stage " + str(a.stage) + " has no predecessor on another rank", r, step);
          received[{a.stage, 0, a.microbatch}] = true;
          recvs[{s.stage_to_rank[prev], r}].push_back({{a.stage, 0, a.microbatch}, step});
          break;
        case ActionType::RECV_B:
          if (next < 0 || s.stage_to_rank[next] == r) fail(s, a.str() + ": stage " + str(a.stage) + " has no successor on another rank", r, step);
          received[{a.stage, 1, a.microbatch}] = true;
          recvs[{s.stage_to_rank[next], r}].push_back({{a.stage, 1, a.microbatch}, step});
          break;
        case ActionType::F:
          produced[{a.stage, 0, a.microbatch}] = true;
          if (prev >= 0 && s.stage_to_rank[prev] != r && !received.count({a.stage, 0, a.microbatch}))
            fail(s, a.str() + " has no RECV_F posted before it", r, step);
          break;
        case ActionType::I:
        case ActionType::B:
          produced[{a.stage, 1, a.microbatch}] = true;
          if (next >= 0 && s.stage_to_rank[next] != r && !received.count({a.stage, 1, a.microbatch}))
            fail(s, a.str() + " has no RECV_B posted before it", r, step);
          break;
        default:
          break;
      }
    }
  }
  auto msg_str = [](const Msg& m) {
    auto [stage, dir, mb] = m;
    return Action{stage, dir ? ActionType::RECV_B : ActionType::RECV_F, mb}.str();
  };
  for (int src = 0; src < s.num_ranks; src++) {
    for (int dst = 0; dst < s.num_ranks; dst++) {
      const auto& out = sends[{src, dst}];
      const auto& in = recvs[{src, dst}];
      for (size_t k = 0; k < std::max(out.size(), in.size()); k++) {
        if (k < out.size() && k < in.size() && out[k].first == in[k].first) continue;
        std::ostringstream what;
        what << "sends from rank " << src << " to rank " << dst << " and receives do not match in order: message "
             << k << " is " << (k < out.size() ? msg_str(out[k].first) : "<none>") << " sent but "
             << (k < in.size() ? msg_str(in[k].first) : "<none>") << " received";
        if (k < in.size()) fail(s, what.str(), dst, in[k].second);
        fail(s, what.str(), src, out[k].second);
      }
    }
  }
}

}  // namespace

void validate(const Schedule& s) {
  check_shape(s);
  check_compute(s);
  if (s.lowered) check_comms(s);
  simulate(s, Costs{});  // deadlock check: throws with the blocked steps marked
}

}  // namespace torchpp::schedule
