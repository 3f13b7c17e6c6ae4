#include "schedule/generators.h"

#include <functional>
#include <algorithm>
#include <map>
#include <sstream>

#include "schedule/errors.h"
#include "schedule/generators_impl.h"

namespace torchpp::schedule {

namespace {


std::string values(const GenerateOptions& o) {
  return "p=" + std::to_string(o.num_ranks) + ", m=" + std::to_string(o.num_microbatches) +
         ", v=" + std::to_string(o.num_chunks);
}

// Schedules with a fixed number of stages per rank accept num_chunks=0 (default) or that number.
void require_chunks(const std::string& name, const GenerateOptions& o, int chunks) {
  if (o.num_chunks != 0 && o.num_chunks != chunks) {
    constraint_error(name, "num_chunks == " + std::to_string(chunks) + " (stages per rank)", values(o));
  }
}

// Microbatches per depth-first group of the interleaved orders: the option, or Megatron's p when
// it divides m, else the next divisor of m above p.
int interleaved_group(const std::string& name, const GenerateOptions& o) {
  int m = o.num_microbatches;
  int group = o.microbatch_group_size;
  if (group == 0) {
    group = std::min(o.num_ranks, m);
    while (m % group) group++;
  }
  // Smaller groups make rank 0 wait on its own microbatches and the 1F1B order deadlocks.
  if (group < std::min(o.num_ranks, m) || m % group) {
    constraint_error(name, "microbatch_group_size dividing m and >= min(p, m)",
                     values(o) + ", microbatch_group_size=" + std::to_string(group));
  }
  return group;
}

std::string format(double value) {
  std::ostringstream out;
  out << value;
  return out.str();
}

// The searched generators weigh activations by M_B > 0 and pending W's by M_W >= 0, and
// minimize the makespan or the span first; returns whether the span.
bool check_search_options(const std::string& name, const GenerateOptions& o) {
  const MemoryUnits& u = o.memory;
  if (!(u.activation > 0) || !(u.weight_pending >= 0)) {
    constraint_error(name, "M_B > 0 and M_W >= 0", "M_B=" + format(u.activation) + ", M_W=" + format(u.weight_pending));
  }
  if (o.objective != "makespan" && o.objective != "span") {
    constraint_error(name, "objective \"makespan\" or \"span\"", "objective=\"" + o.objective + "\"");
  }
  return o.objective == "span";
}

// Per-stage costs drive the cost-aware generators: one entry per stage of the schedule.
void check_stage_costs(const std::string& name, const GenerateOptions& o, int stages) {
  const std::pair<const char*, const std::vector<double>*> fields[] = {
      {"f", &o.costs.stage_f}, {"i", &o.costs.stage_i}, {"w", &o.costs.stage_w}};
  for (const auto& [field, given] : fields) {
    if (!given->empty() && static_cast<int>(given->size()) != stages) {
      constraint_error(name, "one " + std::string(field) + " cost per stage (" + std::to_string(stages) + " stages)",
                       values(o) + ", " + std::to_string(given->size()) + " " + field + " costs");
    }
  }
}

// The V family: zb-v searches under its limit (default 2p M_B); v-half and v-min are their
// building blocks unless given a limit, which makes them search like zb-v (memory_limit spans
// V-Min's memory up to zb-v's).
Schedule v_family(const std::string& name, const GenerateOptions& o) {
  require_chunks(name, o, 2);
  check_stage_costs(name, o, 2 * o.num_ranks);
  bool span_first = check_search_options(name, o);
  if (name != "zb-v" && o.memory_limit <= 0) {
    return name == "v-min" ? detail::v_min(o.num_ranks, o.num_microbatches)
                           : detail::v_half(o.num_ranks, o.num_microbatches);
  }
  double limit = o.memory_limit > 0 ? o.memory_limit : 2.0 * o.num_ranks * o.memory.activation;
  if (limit < 2 * o.memory.activation) {
    constraint_error(name,
                     "memory_limit >= 2 M_B = " + format(2 * o.memory.activation) + " (both stages of a rank in flight)",
                     "memory_limit=" + format(limit));
  }
  return detail::v_search(name, o.num_ranks, o.num_microbatches, o.costs, o.memory, limit, span_first);
}

using Generator = std::function<Schedule(const GenerateOptions&)>;

const std::map<std::string, Generator>& registry() {
  static const std::map<std::string, Generator> generators = {
      {"gpipe", [](const GenerateOptions& o) {
         require_chunks("gpipe", o, 1);
         return detail::gpipe(o.num_ranks, o.num_microbatches);
       }},
      {"1f1b", [](const GenerateOptions& o) {
         require_chunks("1f1b", o, 1);
         return detail::one_f_one_b(o.num_ranks, o.num_microbatches);
       }},
      {"eager-1f1b", [](const GenerateOptions& o) {
         require_chunks("eager-1f1b", o, 1);
         return detail::eager_one_f_one_b(o.num_ranks, o.num_microbatches);
       }},
      {"interleaved-1f1b", [](const GenerateOptions& o) {
         return detail::interleaved_1f1b(o.num_ranks, o.num_microbatches, o.num_chunks ? o.num_chunks : 2,
                                         interleaved_group("interleaved-1f1b", o));
       }},
      {"interleaved-zb", [](const GenerateOptions& o) {
         return detail::interleaved_zero_bubble(o.num_ranks, o.num_microbatches, o.num_chunks ? o.num_chunks : 2,
                                                interleaved_group("interleaved-zb", o));
       }},
      {"looped-bfs", [](const GenerateOptions& o) {
         return detail::looped_bfs(o.num_ranks, o.num_microbatches, o.num_chunks ? o.num_chunks : 2);
       }},
      {"zb-h1", [](const GenerateOptions& o) {
         require_chunks("zb-h1", o, 1);
         return detail::zb_h1(o.num_ranks, o.num_microbatches);
       }},
      {"zb-h2", [](const GenerateOptions& o) {
         require_chunks("zb-h2", o, 1);
         return detail::zb_h2(o.num_ranks, o.num_microbatches);
       }},
      {"zb-auto", [](const GenerateOptions& o) {
         require_chunks("zb-auto", o, 1);
         check_stage_costs("zb-auto", o, o.num_ranks);
         bool span_first = check_search_options("zb-auto", o);
         double limit = o.memory_limit > 0 ? o.memory_limit : o.num_ranks * o.memory.activation;
         double least = std::max(o.memory.activation, o.memory.weight_pending);
         if (limit < least) {
           constraint_error("zb-auto", "memory_limit >= max(M_B, M_W) = " + format(least) + " (one microbatch in flight per rank)",
                            "memory_limit=" + format(limit));
         }
         return detail::zb_auto(o.num_ranks, o.num_microbatches, o.costs, o.memory, limit, span_first);
       }},
      {"zb-v", [](const GenerateOptions& o) { return v_family("zb-v", o); }},
      {"v-half", [](const GenerateOptions& o) { return v_family("v-half", o); }},
      {"v-min", [](const GenerateOptions& o) { return v_family("v-min", o); }},
      {"dualpipe", [](const GenerateOptions& o) {
         require_chunks("dualpipe", o, 2);
         if (o.num_ranks % 2) constraint_error("dualpipe", "an even number of ranks p", values(o));
         if (o.num_microbatches % 2) constraint_error("dualpipe", "an even number of microbatches m (half enter at each end)", values(o));
         if (o.num_microbatches < 2 * o.num_ranks) constraint_error("dualpipe", "m >= 2p", values(o));
         return detail::dualpipe(o.num_ranks, o.num_microbatches);
       }},
      {"dualpipe-v", [](const GenerateOptions& o) {
         require_chunks("dualpipe-v", o, 2);
         if (o.num_microbatches < 2 * o.num_ranks) constraint_error("dualpipe-v", "m >= 2p (p = ranks)", values(o));
         return detail::dualpipe_v(o.num_ranks, o.num_microbatches);
       }},
  };
  return generators;
}

}  // namespace

std::vector<std::string> schedule_names() {
  return {"gpipe", "1f1b", "eager-1f1b", "interleaved-1f1b", "looped-bfs", "zb-h1",
          "zb-h2", "zb-auto", "interleaved-zb", "zb-v", "v-half", "v-min", "dualpipe", "dualpipe-v"};
}

Schedule generate(const std::string& name, const GenerateOptions& o) {
  auto it = registry().find(name);
  if (it == registry().end()) {
    std::string known;
    for (const auto& n : schedule_names()) known += (known.empty() ? "" : ", ") + n;
    throw std::invalid_argument("unknown schedule '" + name + "'; known: " + known);
  }
  if (o.num_ranks < 1) constraint_error(name, "num_ranks >= 1", values(o));
  if (o.num_microbatches < 1) constraint_error(name, "num_microbatches >= 1", values(o));
  if (o.num_chunks < 0) constraint_error(name, "num_chunks >= 1", values(o));
  return it->second(o);
}

}  // namespace torchpp::schedule
