// torchpp._plan: the torch-free partitioner behind pybind11 (std::invalid_argument -> ValueError).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <limits>
#include <stdexcept>
#include <string>

#include "plan/partitioner.h"

namespace py = pybind11;
using namespace torchpp::plan;

namespace {

Placement parse_placement(const std::string& name) {
  if (name == "interleaved") return Placement::kInterleaved;
  if (name == "v-shape") return Placement::kVShape;
  throw std::invalid_argument("placement must be 'interleaved' or 'v-shape', got '" + name + "'");
}

LayerCosts make_costs(std::vector<double> compute, std::vector<double> activation_bytes,
                      std::vector<double> parameter_bytes, std::vector<double> state_bytes,
                      std::vector<double> saved_activation_bytes) {
  return LayerCosts{std::move(compute), std::move(activation_bytes), std::move(parameter_bytes),
                    std::move(state_bytes), std::move(saved_activation_bytes)};
}

PartitionOptions make_options(int num_workers, double activation_bandwidth, bool allow_replication,
                              int max_replicas, double sync_bandwidth, double memory_budget,
                              std::vector<double> inflight, int num_chunks, const std::string& placement) {
  PartitionOptions options;
  options.num_workers = num_workers;
  options.activation_bandwidth = activation_bandwidth;
  options.allow_replication = allow_replication;
  options.max_replicas = max_replicas;
  options.sync_bandwidth = sync_bandwidth;
  options.memory_budget = memory_budget;
  options.inflight = std::move(inflight);
  options.num_chunks = num_chunks;
  options.placement = parse_placement(placement);
  return options;
}

constexpr double kInf = std::numeric_limits<double>::infinity();

}  // namespace

// ---- module: the Partition result and the two entry points ----
PYBIND11_MODULE(_plan, m) {
  m.doc() = "torchpp's partitioner (PipeDream's DP, memory-aware, chunked placements); torch-free C++";

  py::class_<Partition>(m, "Partition")
      .def_readonly("boundaries", &Partition::boundaries)
      .def_readonly("replicas", &Partition::replicas)
      .def_readonly("stage_rank", &Partition::stage_rank)
      .def_readonly("stage_time", &Partition::stage_time)
      .def_readonly("stage_memory", &Partition::stage_memory)
      .def_readonly("rank_time", &Partition::rank_time)
      .def_readonly("rank_memory", &Partition::rank_memory)
      .def_readonly("comm_time", &Partition::comm_time)
      .def_readonly("bottleneck", &Partition::bottleneck);

  auto solve = [](std::vector<double> compute, std::vector<double> activation_bytes,
                  std::vector<double> parameter_bytes, std::vector<double> state_bytes,
                  std::vector<double> saved_activation_bytes, int num_workers, double activation_bandwidth,
                  bool allow_replication, int max_replicas, double sync_bandwidth, double memory_budget,
                  std::vector<double> inflight, int num_chunks, const std::string& placement) {
    const LayerCosts costs = make_costs(std::move(compute), std::move(activation_bytes), std::move(parameter_bytes),
                                        std::move(state_bytes), std::move(saved_activation_bytes));
    const PartitionOptions options = make_options(num_workers, activation_bandwidth, allow_replication, max_replicas,
                                                  sync_bandwidth, memory_budget, std::move(inflight), num_chunks,
                                                  placement);
    py::gil_scoped_release no_gil;
    return partition(costs, options);
  };
  m.def("partition", solve, py::arg("compute"), py::arg("activation_bytes") = std::vector<double>{},
        py::arg("parameter_bytes") = std::vector<double>{}, py::arg("state_bytes") = std::vector<double>{},
        py::arg("saved_activation_bytes") = std::vector<double>{}, py::arg("num_workers") = 1,
        py::arg("activation_bandwidth") = kInf, py::arg("allow_replication") = false, py::arg("max_replicas") = 0,
        py::arg("sync_bandwidth") = kInf, py::arg("memory_budget") = kInf,
        py::arg("inflight") = std::vector<double>{}, py::arg("num_chunks") = 1,
        py::arg("placement") = std::string("interleaved"),
        "Exact split of a layer chain into stages minimising the slowest rank; see csrc/plan/partitioner.h.");

  auto score = [](std::vector<int> boundaries, std::vector<int> replicas, std::vector<double> compute,
                  std::vector<double> activation_bytes, std::vector<double> parameter_bytes,
                  std::vector<double> state_bytes, std::vector<double> saved_activation_bytes, int num_workers,
                  double activation_bandwidth, bool allow_replication, int max_replicas, double sync_bandwidth,
                  double memory_budget, std::vector<double> inflight, int num_chunks, const std::string& placement) {
    const LayerCosts costs = make_costs(std::move(compute), std::move(activation_bytes), std::move(parameter_bytes),
                                        std::move(state_bytes), std::move(saved_activation_bytes));
    const PartitionOptions options = make_options(num_workers, activation_bandwidth, allow_replication, max_replicas,
                                                  sync_bandwidth, memory_budget, std::move(inflight), num_chunks,
                                                  placement);
    return evaluate(costs, options, boundaries, replicas);
  };
  m.def("evaluate", score, py::arg("boundaries"), py::arg("replicas"), py::arg("compute"),
        py::arg("activation_bytes") = std::vector<double>{}, py::arg("parameter_bytes") = std::vector<double>{},
        py::arg("state_bytes") = std::vector<double>{}, py::arg("saved_activation_bytes") = std::vector<double>{},
        py::arg("num_workers") = 1, py::arg("activation_bandwidth") = kInf, py::arg("allow_replication") = false,
        py::arg("max_replicas") = 0, py::arg("sync_bandwidth") = kInf, py::arg("memory_budget") = kInf,
        py::arg("inflight") = std::vector<double>{}, py::arg("num_chunks") = 1,
        py::arg("placement") = std::string("interleaved"),
        "Times and memory of a given split under the partitioner's cost model.");
}
