#include "schedule/sweep.h"

#include <stdexcept>

#include "schedule/generators.h"
#include "schedule/in_order_p2p.h"
#include "schedule/lowering.h"
#include "schedule/validator.h"

namespace torchpp::schedule {

SweepResult sweep(const std::vector<std::string>& names, int max_ranks, int max_microbatches,
                  int max_chunks, const Costs& costs) {
  SweepResult result;
  for (const std::string& name : names) {
    for (int p = 1; p <= max_ranks; p++) {
      for (int m = 1; m <= max_microbatches; m++) {
        for (int v = 1; v <= max_chunks; v++) {
          std::string where = name + " p=" + std::to_string(p) + " m=" + std::to_string(m) +
                              " v=" + std::to_string(v) + ": ";
          GenerateOptions options;
          options.num_ranks = p;
          options.num_microbatches = m;
          options.num_chunks = v;
          options.costs = costs;
          Schedule schedule;
          try {
            schedule = generate(name, options);
          } catch (const std::invalid_argument& e) {
            // The documented form is "<name>: requires <constraint> (got <values>)".
            std::string what = e.what();
            if (what.rfind(name + ": requires ", 0) == 0) result.rejected++;
            else result.failures.push_back(where + "undocumented error: " + what);
            continue;
          } catch (const std::exception& e) {
            result.failures.push_back(where + e.what());
            continue;
          }
          try {
            validate(schedule);
            validate(lower(schedule));
            const Schedule in_order = lower_in_order(schedule);
            validate(in_order);
            check_in_order_p2p(in_order);
            simulate(schedule, costs);
            result.served++;
          } catch (const std::exception& e) {
            std::string what = e.what();
            result.failures.push_back(where + what.substr(0, what.find('\n')));
          }
        }
      }
    }
  }
  return result;
}

}  // namespace torchpp::schedule
