// Torch-free unit test of csrc/schedule: built with g++ alone by tests/schedule/test_cpp.py.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <stdexcept>
#include <string>

#include "schedule/csv.h"
#include "schedule/errors.h"
#include "schedule/generators.h"
#include "schedule/lowering.h"
#include "schedule/simulator.h"
#include "schedule/sweep.h"
#include "schedule/validator.h"

using namespace torchpp::schedule;

static int failures = 0;
#define CHECK(cond)                                                       \
  do {                                                                    \
    if (!(cond)) {                                                        \
      std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      failures++;                                                         \
    }                                                                     \
  } while (0)

static Schedule gen(const char* name, int p, int m, int v = 0) {
  GenerateOptions o;
  o.num_ranks = p;
  o.num_microbatches = m;
  o.num_chunks = v;
  return generate(name, o);
}

static double max_span(const Simulation& sim) {
  double span = 0;
  for (size_t r = 0; r < sim.span_end.size(); r++) span = std::fmax(span, sim.span_end[r] - sim.span_start[r]);
  return span;
}

int main() {
  // Action strings round-trip in torch's spelling.
  for (const char* text : {"0F3", "1I0", "2W5", "3B1", "1SEND_F3", "2RECV_B0", "12RECV_F104"}) {
    CHECK(Action::parse(text).str() == text);
  }
  bool threw = false;
  try { Action::parse("0Q1"); } catch (const std::invalid_argument&) { threw = true; }
  CHECK(threw);

  // Closed forms at F=I=W=1, comm=0.
  for (int p : {2, 4, 8}) {
    int m = 3 * p;
    Simulation one = simulate(gen("1f1b", p, m), Costs{});
    CHECK(one.makespan == (m + p - 1) * 3.0);
    CHECK(one.peak_activations[0] == p);
    Simulation h1 = simulate(gen("zb-h1", p, m), Costs{});
    CHECK(max_span(h1) - h1.busy[0] == (p - 1) * 1.0);
    Simulation h2 = simulate(gen("zb-h2", p, m), Costs{});
    CHECK(h2.bubble_ratio == 0.0);
    CHECK(h2.peak_activations[0] == 2 * p - 1);
  }

  // V-Min and V-Half: the paper's peak memory, counted F to W (M_W = M_B), two stages a rank.
  for (int p : {2, 3, 4, 5, 6, 8}) {
    MemoryUnits f_to_w{1.0, 1.0};
    Simulation v_min = simulate(gen("v-min", p, 3 * p), Costs{}, f_to_w);
    Simulation v_half = simulate(gen("v-half", p, 3 * p), Costs{}, f_to_w);
    for (int r = 0; r < p; r++) {
      CHECK(v_min.peak_memory[r] <= 2.0 * ((p + 4) / 3));
      CHECK(v_half.peak_memory[r] <= 2.0 * ((p + 2) / 2));
    }
    CHECK(*std::max_element(v_half.peak_memory.begin(), v_half.peak_memory.end()) == 2.0 * ((p + 2) / 2));
  }

  // Lowering, CSV and validation agree.
  Schedule dual = gen("dualpipe", 4, 8);
  CHECK(dual.num_pipelines == 2 && dual.stage_to_rank[4] == 3 && dual.model_stage(4) == 0);
  Schedule lowered = lower(dual);
  validate(lowered);
  Schedule back = from_csv(to_csv(lowered), 4, 8);
  CHECK(back.lowered && back.num_pipelines == 2 && back.actions == lowered.actions);

  // Constraint errors name the constraint.
  threw = false;
  try { gen("dualpipe", 3, 12); } catch (const std::invalid_argument& e) {
    threw = std::string(e.what()).find("even number of ranks") != std::string::npos;
  }
  CHECK(threw);

  // zb-auto over the full grid (the Python suite sweeps it too; this runs without torch).
  SweepResult auto_grid = sweep({"zb-auto"}, 16, 64, 1);
  CHECK(auto_grid.failures.empty());
  CHECK(auto_grid.served == 16 * 64);
  for (const auto& f : auto_grid.failures) std::fprintf(stderr, "%s\n", f.c_str());

  // Every other generator on a smaller grid.
  std::vector<std::string> names = schedule_names();
  SweepResult grid = sweep(names, 8, 24, 4);
  CHECK(grid.failures.empty());
  for (const auto& f : grid.failures) std::fprintf(stderr, "%s\n", f.c_str());

  if (failures) {
    std::fprintf(stderr, "%d checks failed\n", failures);
    return 1;
  }
  std::printf("test_schedule: all checks passed (%d + %d schedules served)\n", auto_grid.served, grid.served);
  return 0;
}
