#include "schedule/trace.h"

#include <algorithm>
#include <cstdio>
#include <sstream>

namespace torchpp::schedule {

namespace {

constexpr int kComputeTrack = 0;
constexpr int kCommTrack = 1;
constexpr int kOverlapTrack = 2;  // compute run at once with the compute track's (real runs)

std::string number(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.6g", v);
  return buf;
}

std::string slice(const std::string& name, const std::string& cat, int pid, int tid, double ts,
                  double dur, const std::string& args) {
  return "{\"name\":\"" + name + "\",\"cat\":\"" + cat + "\",\"ph\":\"X\",\"pid\":" +
         std::to_string(pid) + ",\"tid\":" + std::to_string(tid) + ",\"ts\":" + number(ts) +
         ",\"dur\":" + number(dur) + ",\"args\":{" + args + "}}";
}

std::string metadata(const char* what, int pid, int tid, const std::string& name) {
  return std::string("{\"name\":\"") + what + "\",\"ph\":\"M\",\"pid\":" + std::to_string(pid) +
         ",\"tid\":" + std::to_string(tid) + ",\"args\":{\"name\":\"" + name + "\"}}";
}

}  // namespace

std::string chrome_trace_json(const Schedule& s, const Simulation& sim, double scale) {
  std::vector<std::string> events;
  for (int r = 0; r < s.num_ranks; r++) {
    events.push_back(metadata("process_name", r, 0, "rank " + std::to_string(r)));
    events.push_back(metadata("thread_name", r, kComputeTrack, "compute"));
    events.push_back(metadata("thread_name", r, kCommTrack, "comm"));
    double compute_end = -1e300;
    bool overlapped = false;
    for (const TimedAction& t : sim.timeline[r]) {
      // An action that starts before the previous one ended ran at once with it (the executor's
      // forward-backward overlap): its own track, so neither hides the other.
      const bool concurrent = t.start < compute_end;
      if (concurrent && !overlapped) {
        events.push_back(metadata("thread_name", r, kOverlapTrack, "compute (overlapped)"));
        overlapped = true;
      }
      if (!concurrent) compute_end = t.end;
      events.push_back(slice(t.action.str(), action_type_name(t.action.type), r, concurrent ? kOverlapTrack : kComputeTrack,
                             t.start * scale, (t.end - t.start) * scale,
                             "\"stage\":" + std::to_string(t.action.stage) +
                                 ",\"microbatch\":" + std::to_string(t.action.microbatch)));
    }
  }
  // Transfers need a visible width for the flow arrows to bind, even at zero latency.
  int id = 0;
  for (const Transfer& x : sim.transfers) {
    bool forward = x.producer.type == ActionType::F;
    Action send{x.producer.stage, forward ? ActionType::SEND_F : ActionType::SEND_B, x.producer.microbatch};
    Action recv{x.consumer.stage, forward ? ActionType::RECV_F : ActionType::RECV_B, x.consumer.microbatch};
    double ts = x.send_time * scale;
    double dur = std::max((x.arrive_time - x.send_time) * scale, 0.01 * scale);
    std::string args = "\"src\":" + std::to_string(x.src_rank) + ",\"dst\":" + std::to_string(x.dst_rank);
    events.push_back(slice(send.str(), "SEND", x.src_rank, kCommTrack, ts, dur, args));
    events.push_back(slice(recv.str(), "RECV", x.dst_rank, kCommTrack, ts, dur, args));
    std::string flow = ",\"cat\":\"p2p\",\"name\":\"p2p\",\"id\":" + std::to_string(id++) + ",\"ts\":" + number(ts);
    events.push_back("{\"ph\":\"s\",\"pid\":" + std::to_string(x.src_rank) + ",\"tid\":" +
                     std::to_string(kCommTrack) + flow + "}");
    events.push_back("{\"ph\":\"f\",\"bp\":\"e\",\"pid\":" + std::to_string(x.dst_rank) + ",\"tid\":" +
                     std::to_string(kCommTrack) + flow + "}");
  }
  std::ostringstream out;
  out << "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n";
  for (size_t k = 0; k < events.size(); k++) out << events[k] << (k + 1 < events.size() ? ",\n" : "\n");
  out << "]}\n";
  return out.str();
}

}  // namespace torchpp::schedule
