// torchpp._schedule: pybind11 face of the torch-free schedule compiler (csrc/schedule).
// pybind11 comes from torch's include directory; no torch header is included.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "schedule/csv.h"
#include "schedule/errors.h"
#include "schedule/generators.h"
#include "schedule/grid.h"
#include "schedule/in_order_p2p.h"
#include "schedule/lowering.h"
#include "schedule/simulator.h"
#include "schedule/sweep.h"
#include "schedule/trace.h"
#include "schedule/validator.h"

namespace py = pybind11;
using namespace torchpp::schedule;

namespace {

Costs make_costs(double f, double i, double w, double comm, std::vector<double> stage_f,
                 std::vector<double> stage_i, std::vector<double> stage_w) {
  Costs costs;
  costs.f = f;
  costs.i = i;
  costs.w = w;
  costs.comm = comm;
  costs.stage_f = std::move(stage_f);
  costs.stage_i = std::move(stage_i);
  costs.stage_w = std::move(stage_w);
  return costs;
}

}  // namespace

PYBIND11_MODULE(_schedule, m) {
  m.doc() = "torchpp schedule compiler (torch-free C++): IR, generators, lowering, validation, simulation";
  static py::exception<ScheduleError> schedule_error(m, "ScheduleError", PyExc_ValueError);
  py::register_exception_translator([](std::exception_ptr error) {
    try {
      if (error) std::rethrow_exception(error);
    } catch (const ScheduleError& e) {
      py::set_error(schedule_error, e.what());
    }
  });

  // ---- IR ----
  py::class_<Schedule>(m, "Schedule")
      .def_readonly("name", &Schedule::name)
      .def_readonly("num_ranks", &Schedule::num_ranks)
      .def_readonly("num_stages", &Schedule::num_stages)
      .def_readonly("num_microbatches", &Schedule::num_microbatches)
      .def_readonly("num_pipelines", &Schedule::num_pipelines)
      .def_readonly("stage_to_rank", &Schedule::stage_to_rank)
      .def_readonly("is_lowered", &Schedule::lowered)
      .def("model_stage", &Schedule::model_stage)
      .def("pipeline_of_stage", &Schedule::pipeline_of_stage)
      .def(
          "microbatches_of_pipeline",
          [](const Schedule& s, int pipeline) {
            std::vector<int> out;
            for (int k = s.microbatch_begin(pipeline); k < s.microbatch_end(pipeline); ++k) out.push_back(k);
            return out;
          },
          py::arg("pipeline"))
      .def("actions", &Schedule::action_strings, py::arg("rank"))
      .def(
          "lowered", [](const Schedule& s, bool in_order) { return in_order ? lower_in_order(s) : lower(s); },
          py::arg("in_order") = false)
      .def("check_in_order_p2p", [](const Schedule& s) { check_in_order_p2p(s); })
      .def("compute_only", [](const Schedule& s) { return compute_only(s); })
      .def("forward_only", [](const Schedule& s) { return forward_only(s); })
      .def("validate", [](const Schedule& s) { validate(s); })
      .def("grid", [](const Schedule& s, int max_steps) { return format_grid(s, {}, max_steps); },
           py::arg("max_steps") = 0)
      .def("to_csv", [](const Schedule& s) { return to_csv(s); });

  m.def("schedule_names", &schedule_names);
  m.def(
      "generate",
      [](const std::string& name, int num_ranks, int num_microbatches, int num_chunks, double f,
         double i, double w, double comm, double memory_limit, int microbatch_group_size, double activation,
         double weight_pending, const std::string& objective, std::vector<double> stage_f,
         std::vector<double> stage_i, std::vector<double> stage_w) {
        GenerateOptions o;
        o.num_ranks = num_ranks;
        o.num_microbatches = num_microbatches;
        o.num_chunks = num_chunks;
        o.costs = make_costs(f, i, w, comm, std::move(stage_f), std::move(stage_i), std::move(stage_w));
        o.memory_limit = memory_limit;
        o.memory = MemoryUnits{activation, weight_pending};
        o.objective = objective;
        o.microbatch_group_size = microbatch_group_size;
        py::gil_scoped_release release;
        return generate(name, o);
      },
      py::arg("name"), py::arg("num_ranks"), py::arg("num_microbatches"), py::arg("num_chunks") = 0,
      py::arg("f") = 1.0, py::arg("i") = 1.0, py::arg("w") = 1.0, py::arg("comm") = 0.0,
      py::arg("memory_limit") = 0.0, py::arg("microbatch_group_size") = 0, py::arg("activation") = 1.0,
      py::arg("weight_pending") = 0.5, py::arg("objective") = "makespan",
      py::arg("stage_f") = std::vector<double>{}, py::arg("stage_i") = std::vector<double>{},
      py::arg("stage_w") = std::vector<double>{});
  m.def("from_csv", &from_csv, py::arg("text"), py::arg("num_ranks"), py::arg("num_microbatches"),
        py::arg("num_pipelines") = 0);

  // ---- simulation ----
  py::class_<Simulation>(m, "Simulation")
      .def_readonly("makespan", &Simulation::makespan)
      .def_readonly("bubble_ratio", &Simulation::bubble_ratio)
      .def_readonly("busy", &Simulation::busy)
      .def_readonly("idle", &Simulation::idle)
      .def_readonly("span_start", &Simulation::span_start)
      .def_readonly("span_end", &Simulation::span_end)
      .def_readonly("peak_activations", &Simulation::peak_activations)
      .def_readonly("peak_weight_pending", &Simulation::peak_weight_pending)
      .def_readonly("peak_memory", &Simulation::peak_memory)
      .def_property_readonly("timeline", [](const Simulation& sim) {
        // per rank: [(action, type, stage, microbatch, start, end)]
        std::vector<std::vector<py::tuple>> out(sim.timeline.size());
        for (size_t r = 0; r < sim.timeline.size(); r++) {
          for (const TimedAction& t : sim.timeline[r]) {
            out[r].push_back(py::make_tuple(t.action.str(), action_type_name(t.action.type), t.action.stage,
                                            t.action.microbatch, t.start, t.end));
          }
        }
        return out;
      })
      .def_property_readonly("transfers", [](const Simulation& sim) {
        // [(src_rank, dst_rank, producer, consumer, send_time, arrive_time)]
        std::vector<py::tuple> out;
        for (const Transfer& x : sim.transfers) {
          out.push_back(py::make_tuple(x.src_rank, x.dst_rank, x.producer.str(), x.consumer.str(), x.send_time,
                                       x.arrive_time));
        }
        return out;
      });
  m.def(
      "simulate",
      [](const Schedule& s, double f, double i, double w, double comm, std::vector<double> stage_f,
         std::vector<double> stage_i, std::vector<double> stage_w, double activation, double weight_pending) {
        Costs costs = make_costs(f, i, w, comm, std::move(stage_f), std::move(stage_i), std::move(stage_w));
        for (const auto* per_stage : {&costs.stage_f, &costs.stage_i, &costs.stage_w}) {
          if (!per_stage->empty() && static_cast<int>(per_stage->size()) != s.num_stages) {
            throw std::invalid_argument("per-stage costs need " + std::to_string(s.num_stages) + " entries, got " +
                                        std::to_string(per_stage->size()));
          }
        }
        py::gil_scoped_release release;
        return simulate(s, costs, MemoryUnits{activation, weight_pending});
      },
      py::arg("schedule"), py::arg("f") = 1.0, py::arg("i") = 1.0, py::arg("w") = 1.0, py::arg("comm") = 0.0,
      py::arg("stage_f") = std::vector<double>{}, py::arg("stage_i") = std::vector<double>{},
      py::arg("stage_w") = std::vector<double>{}, py::arg("activation") = 1.0, py::arg("weight_pending") = 0.5);
  m.def("chrome_trace_json", &chrome_trace_json, py::arg("schedule"), py::arg("simulation"),
        py::arg("microseconds_per_unit") = 1000.0);

  // ---- grid sweep (tests) ----
  m.def(
      "sweep",
      [](const std::vector<std::string>& names, int max_ranks, int max_microbatches, int max_chunks) {
        py::gil_scoped_release release;
        SweepResult r = sweep(names, max_ranks, max_microbatches, max_chunks);
        return std::make_tuple(r.served, r.rejected, r.failures);
      },
      py::arg("names"), py::arg("max_ranks"), py::arg("max_microbatches"), py::arg("max_chunks"),
      "Returns (served, rejected, failures) over the grid; failures lists anything that neither "
      "validated nor raised the documented constraint error.");
}
