// torchpp._C: importing it runs the static TORCH_LIBRARY registrations of csrc/ops, and binds
// the pipeline runtime (csrc/runtime) and the weight-gradient store of the split B/W linear.
// The only file that includes torch/extension.h (it is slow to compile).
#include <torch/csrc/jit/python/module_python.h>
#include <torch/extension.h>

#include "ops/byte_collectives.h"
#include "ops/collective_check.h"
#include "ops/pass_groups.h"
#include "ops/split_linear_store.h"
#include "runtime/executor.h"
#include "runtime/failure.h"
#include "runtime/script_stages.h"
#include "schedule/trace.h"

namespace py = pybind11;
using namespace torchpp;

namespace {

py::object pipeline_error;
py::object pipeline_shape_error;
py::object pipeline_config_error;
py::object pipeline_timeout_error;

runtime::FailureKind kind_of(py::error_already_set& error) {
  if (error.matches(pipeline_shape_error)) return runtime::FailureKind::Shape;
  if (error.matches(pipeline_config_error)) return runtime::FailureKind::Config;
  if (error.matches(pipeline_timeout_error)) return runtime::FailureKind::Timeout;
  return runtime::FailureKind::Generic;
}

const py::object& error_type(runtime::FailureKind kind) {
  switch (kind) {
    case runtime::FailureKind::Shape:
      return pipeline_shape_error;
    case runtime::FailureKind::Config:
      return pipeline_config_error;
    case runtime::FailureKind::Timeout:
      return pipeline_timeout_error;
    case runtime::FailureKind::Generic:
      break;
  }
  return pipeline_error;
}

std::string type_name(const py::handle& obj) { return py::str(py::type::of(obj).attr("__name__")); }

// What a stage returned: one tensor, or a non-empty tuple (or list) of tensors.
runtime::Tensors stage_outputs(const py::object& out, int64_t stage, int64_t microbatch) {
  auto reject = [&](const std::string& what) {
    return runtime::PipelineFailure(runtime::FailureKind::Generic,
                                    "stage " + std::to_string(stage) + " returned " + what + " for microbatch " +
                                        std::to_string(microbatch) +
                                        "; a pipeline stage must return a Tensor or a tuple of Tensors");
  };
  if (THPVariable_Check(out.ptr())) return {THPVariable_Unpack(out.ptr())};
  if (!py::isinstance<py::tuple>(out) && !py::isinstance<py::list>(out)) throw reject("a " + type_name(out));
  runtime::Tensors tensors;
  for (const auto& element : out) {
    if (!THPVariable_Check(element.ptr())) throw reject("a " + type_name(out) + " holding a " + type_name(element));
    tensors.push_back(THPVariable_Unpack(element.ptr()));
  }
  if (tensors.empty()) throw reject("an empty " + type_name(out));
  return tensors;
}

// Runs `call` with the GIL; a Python exception becomes a PipelineFailure carrying its message,
// raised while the GIL is still held.
template <typename Call>
auto with_python(Call&& call) {
  py::gil_scoped_acquire gil;
  try {
    return call();
  } catch (py::error_already_set& error) {
    // pybind appends the Python stack ("\n\nAt:..."); the message alone says what failed.
    std::string message = error.what();
    message = message.substr(0, message.find("\n\nAt:"));
    throw runtime::PipelineFailure(kind_of(error), message);
  }
}

// A Python callable the executor's threads may copy and drop without holding the GIL.
std::shared_ptr<py::function> held(py::function fn) {
  return std::shared_ptr<py::function>(new py::function(std::move(fn)), [](py::function* f) {
    if (!Py_IsInitialized()) return;  // a static store emptied after the interpreter ended: leak
    py::gil_scoped_acquire gil;
    delete f;
  });
}

// The Python stage callback as the executor's ForwardFn.
runtime::ForwardFn python_forward(py::function fn) {
  auto shared = held(std::move(fn));
  return [shared](int64_t stage, int64_t microbatch, const runtime::Tensors& inputs) -> runtime::Tensors {
    return with_python([&] {
      py::list args;
      for (const auto& input : inputs) args.append(py::cast(input));
      return stage_outputs((*shared)(stage, microbatch, args), stage, microbatch);
    });
  };
}

runtime::BackwardHook python_backward_hook(py::function fn) {
  auto shared = held(std::move(fn));
  return [shared](int64_t stage, int64_t microbatch, bool split) {
    with_python([&] { (*shared)(stage, microbatch, split); });
  };
}

// Parks a Python callable in the weight-gradient store under the key being captured (the W pass
// calls it); false when nothing captures.
bool defer_python_weight_grad(py::function fn) {
  auto shared = held(std::move(fn));
  return weight_grad_store::defer([shared] { with_python([&] { (*shared)(); }); });
}

std::map<int, runtime::MessageMeta> metas_of(const std::map<int, runtime::Tensors>& examples) {
  std::map<int, runtime::MessageMeta> metas;
  for (const auto& [stage, example] : examples) metas[stage] = runtime::MessageMeta::of(example);
  return metas;
}

std::unique_ptr<runtime::Executor> make_executor(
    int rank, std::vector<std::string> actions, std::vector<int> stage_to_rank, int stages_per_pipeline,
    std::string pp_group, std::string tp_group, int64_t tp_rank, int64_t tp_size, bool scatter_gather, bool in_order,
    std::vector<std::string> abort_groups, c10::Device device, const std::map<int, runtime::Tensors>& expected_inputs,
    const std::map<int, runtime::Tensors>& expected_outputs, std::set<int> backward_hooked_stages, py::object forward,
    py::object after_backward, std::shared_ptr<runtime::ScriptStages> script, double timeout_s,
    std::vector<std::pair<std::string, std::string>> fingerprint, bool overlap_forward_backward) {
  runtime::ExecutorConfig config;
  config.rank = rank;
  config.actions = std::move(actions);
  config.stage_to_rank = std::move(stage_to_rank);
  config.stages_per_pipeline = stages_per_pipeline;
  config.pp_group = std::move(pp_group);
  config.tp_group = std::move(tp_group);
  config.tp_rank = tp_rank;
  config.tp_size = tp_size;
  config.scatter_gather = scatter_gather;
  config.in_order = in_order;
  config.abort_groups = std::move(abort_groups);
  config.device = device;
  config.expected_inputs = metas_of(expected_inputs);
  config.expected_outputs = metas_of(expected_outputs);
  config.backward_hooked_stages = std::move(backward_hooked_stages);
  TORCH_CHECK(timeout_s >= 0, "torchpp pipeline: timeout must be positive seconds (0: the group's own), got ", timeout_s);
  config.timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000.0 + 0.5));
  config.fingerprint.fields = std::move(fingerprint);
  config.overlap_forward_backward = overlap_forward_backward;
  runtime::BackwardHook hook;
  if (!after_backward.is_none()) hook = python_backward_hook(after_backward.cast<py::function>());
  if (script) {  // TorchScript stages: the forward never enters Python
    return std::make_unique<runtime::Executor>(
        std::move(config),
        [script](int64_t stage, int64_t microbatch, const runtime::Tensors& inputs) {
          return (*script)(stage, microbatch, inputs);
        },
        std::move(hook));
  }
  TORCH_CHECK(!forward.is_none(), "torchpp pipeline: an executor needs a forward callback or TorchScript stages");
  return std::make_unique<runtime::Executor>(std::move(config), python_forward(forward.cast<py::function>()),
                                             std::move(hook));
}

torch::jit::Module script_module(const py::handle& obj, const std::string& what) {
  auto module = torch::jit::as_module(obj);
  TORCH_CHECK(module.has_value(), "torchpp pipeline: ", what, " is not a torch.jit.ScriptModule");
  return *module;
}

std::shared_ptr<runtime::ScriptStages> make_script_stages(const std::map<int, py::object>& modules,
                                                          const py::object& loss, int stages_per_pipeline,
                                                          bool scale_grads,
                                                          const std::map<int, runtime::Tensors>& expected_outputs) {
  std::map<int, torch::jit::Module> scripted;
  for (const auto& [stage, module] : modules) {
    scripted.emplace(stage, script_module(module, "stage " + std::to_string(stage)));
  }
  std::optional<torch::jit::Module> loss_module;
  if (!loss.is_none()) loss_module = script_module(loss, "loss_fn");
  return std::make_shared<runtime::ScriptStages>(scripted, loss_module ? &*loss_module : nullptr,
                                                 stages_per_pipeline, scale_grads, metas_of(expected_outputs));
}

// The simulator's Chrome-trace writer, fed with measured times (microseconds) instead.
std::string real_run_chrome_trace(
    int num_ranks,
    const std::vector<std::vector<std::tuple<std::string, double, double>>>& compute,
    const std::vector<std::tuple<int, int, std::string, std::string, double, double>>& transfers) {
  schedule::Schedule layout;
  layout.num_ranks = num_ranks;
  schedule::Simulation measured;
  measured.timeline.resize(num_ranks);
  for (int r = 0; r < num_ranks; r++) {
    for (const auto& [action, start, end] : compute.at(r)) {
      measured.timeline[r].push_back(schedule::TimedAction{schedule::Action::parse(action), start, end});
    }
  }
  for (const auto& [src, dst, producer, consumer, sent, arrived] : transfers) {
    measured.transfers.push_back(schedule::Transfer{src, dst, schedule::Action::parse(producer),
                                                    schedule::Action::parse(consumer), sent, arrived});
  }
  return schedule::chrome_trace_json(layout, measured, /*microseconds_per_unit=*/1.0);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "torchpp C++ extension: torch.ops.torchpp registrations and the pipeline runtime";

  pipeline_error = py::reinterpret_steal<py::object>(
      PyErr_NewException("torchpp._C.PipelineError", PyExc_RuntimeError, nullptr));
  pipeline_shape_error = py::reinterpret_steal<py::object>(
      PyErr_NewException("torchpp._C.PipelineShapeError", pipeline_error.ptr(), nullptr));
  pipeline_config_error = py::reinterpret_steal<py::object>(
      PyErr_NewException("torchpp._C.PipelineConfigError", pipeline_error.ptr(), nullptr));
  // Also a TimeoutError, so `except TimeoutError` catches it.
  pipeline_timeout_error = py::reinterpret_steal<py::object>(PyErr_NewException(
      "torchpp._C.PipelineTimeoutError", py::make_tuple(pipeline_error, py::handle(PyExc_TimeoutError)).ptr(), nullptr));
  m.attr("PipelineError") = pipeline_error;
  m.attr("PipelineShapeError") = pipeline_shape_error;
  m.attr("PipelineConfigError") = pipeline_config_error;
  m.attr("PipelineTimeoutError") = pipeline_timeout_error;
  py::register_exception_translator([](std::exception_ptr error) {
    try {
      if (error) std::rethrow_exception(error);
    } catch (const runtime::PipelineFailure& failure) {
      PyErr_SetString(error_type(failure.kind()).ptr(), failure.what());
    }
  });

  // ---- Shape checks before collectives over gloo (ops/collective_check.h) ----
  m.def("collective_checks", &collective_checks);
  m.def("set_collective_checks", &set_collective_checks, py::arg("enabled"));

  // ---- Byte collectives under the object gathers (ops/byte_collectives.h): no GIL while they wait ----
  m.def(
      "all_gather_bytes",
      [](const std::string& group_name, const py::bytes& mine, c10::Device device) {
        std::string data = mine;
        std::vector<std::string> gathered;
        {
          py::gil_scoped_release no_gil;
          gathered = all_gather_bytes(group_name, data, device);
        }
        py::list out;
        for (const auto& bytes : gathered) out.append(py::bytes(bytes));
        return out;
      },
      py::arg("group_name"), py::arg("mine"), py::arg("device"));
  m.def(
      "broadcast_bytes",
      [](const std::string& group_name, int64_t src, const py::bytes& mine, c10::Device device) {
        std::string data = mine;
        std::string received;
        {
          py::gil_scoped_release no_gil;
          received = broadcast_bytes(group_name, src, data, device);
        }
        return py::bytes(received);
      },
      py::arg("group_name"), py::arg("src"), py::arg("mine"), py::arg("device"));

  // ---- Twin groups of the backward pass (ops/pass_groups.h) ----
  m.def("set_backward_group", &set_backward_group, py::arg("group_name"), py::arg("twin_name"));
  m.def("group_for_current_pass", &group_for_current_pass, py::arg("group_name"));

  // ---- Weight-gradient store of the split B/W linear ----
  m.def("wgrad_begin_capture", &weight_grad_store::begin_capture, py::arg("stage"), py::arg("microbatch"));
  m.def("wgrad_end_capture", &weight_grad_store::end_capture);
  m.def("wgrad_capturing", &weight_grad_store::capturing);
  m.def("wgrad_run", &weight_grad_store::run, py::arg("stage"), py::arg("microbatch"),
        py::call_guard<py::gil_scoped_release>());
  m.def("wgrad_pending", &weight_grad_store::pending);
  m.def("wgrad_clear", &weight_grad_store::clear);
  m.def("wgrad_parked_for", &weight_grad_store::parked_for, py::arg("param"));
  m.def("wgrad_in_deferred_accumulate", &weight_grad_store::in_deferred_accumulate);
  m.def("wgrad_set_main_grad", &weight_grad_store::set_main_grad, py::arg("param"), py::arg("main_grad"));
  m.def("wgrad_defer", &defer_python_weight_grad, py::arg("fn"));

  // ---- Pipeline executor ----
  py::class_<runtime::ScriptStages, std::shared_ptr<runtime::ScriptStages>>(m, "ScriptStages")
      .def(py::init(&make_script_stages), py::arg("modules"), py::arg("loss"), py::arg("stages_per_pipeline"),
           py::arg("scale_grads"), py::arg("expected_outputs") = std::map<int, runtime::Tensors>{})
      .def("set_step", &runtime::ScriptStages::set_step, py::arg("inputs"), py::arg("targets"), py::arg("weights"))
      .def("losses", &runtime::ScriptStages::losses)
      .def("outputs", [](const runtime::ScriptStages& self) {
        // microbatch -> its output: a tensor, or a tuple of tensors
        py::dict out;
        for (const auto& [microbatch, value] : self.outputs()) {
          if (value.isTensor()) {
            out[py::int_(microbatch)] = py::cast(value.toTensor());
            continue;
          }
          py::list elements;
          for (const auto& element : value.toTupleRef().elements()) elements.append(py::cast(element.toTensor()));
          out[py::int_(microbatch)] = py::tuple(elements);
        }
        return out;
      });
  py::class_<runtime::Executor>(m, "Executor")
      .def(py::init(&make_executor), py::arg("rank"), py::arg("actions"), py::arg("stage_to_rank"),
           py::arg("stages_per_pipeline"), py::arg("pp_group"), py::arg("tp_group"), py::arg("tp_rank"),
           py::arg("tp_size"), py::arg("scatter_gather"), py::arg("in_order"), py::arg("abort_groups"), py::arg("device"),
           py::arg("expected_inputs"), py::arg("expected_outputs") = std::map<int, runtime::Tensors>{},
           py::arg("backward_hooked_stages") = std::set<int>{}, py::arg("forward") = py::none(),
           py::arg("after_backward") = py::none(), py::arg("script") = nullptr, py::arg("timeout_s") = 0.0,
           py::arg("fingerprint") = std::vector<std::pair<std::string, std::string>>{},
           py::arg("overlap_forward_backward") = false)
      .def("step", &runtime::Executor::step, py::arg("inputs_changed"), py::call_guard<py::gil_scoped_release>())
      .def("abort_step", &runtime::Executor::abort_step, py::arg("message"), py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("peak_activations", &runtime::Executor::peak_activations)
      .def("timeline", [](const runtime::Executor& self) {
        // [(action, start_us, end_us, arrived_us)]; arrived_us is -1 except for RECV actions.
        std::vector<std::tuple<std::string, double, double, double>> out;
        for (const auto& r : self.timeline().records()) out.emplace_back(r.action, r.start_us, r.end_us, r.arrived_us);
        return out;
      });
  // A last stage's output against its output_args, for the Python stage callback.
  m.def(
      "check_stage_output",
      [](int64_t stage, int64_t microbatch, const runtime::Tensors& output, const runtime::Tensors& expected) {
        runtime::check_expected(runtime::MessageMeta::of(output), runtime::MessageMeta::of(expected), stage, microbatch,
                                "returned", "", "output_args");
      },
      py::arg("stage"), py::arg("microbatch"), py::arg("output"), py::arg("expected"));
  m.def("real_run_chrome_trace", &real_run_chrome_trace, py::arg("num_ranks"), py::arg("compute"),
        py::arg("transfers"));
}
