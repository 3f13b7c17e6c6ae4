#include "runtime/script_stages.h"

#include <optional>
#include <string>

#include <ATen/ATen.h>
#include <torch/csrc/jit/api/module.h>

#include "runtime/failure.h"

namespace torchpp::runtime {

struct ScriptStages::Modules {
  std::map<int, torch::jit::Module> stages;
  std::optional<torch::jit::Module> loss;
};

ScriptStages::ScriptStages(const std::map<int, torch::jit::Module>& modules, const torch::jit::Module* loss,
                           int stages_per_pipeline, bool scale_grads, std::map<int, MessageMeta> expected_outputs)
    : modules_(std::make_unique<Modules>()),
      stages_per_pipeline_(stages_per_pipeline),
      scale_grads_(scale_grads),
      expected_outputs_(std::move(expected_outputs)) {
  modules_->stages = modules;
  if (loss != nullptr) modules_->loss = *loss;
}

ScriptStages::~ScriptStages() = default;

void ScriptStages::set_step(std::vector<at::Tensor> inputs, std::vector<at::Tensor> targets,
                            std::vector<double> weights) {
  inputs_ = std::move(inputs);
  targets_ = std::move(targets);
  weights_ = std::move(weights);
  losses_.clear();
  outputs_.clear();
}

namespace {

[[noreturn]] void bad_result(const c10::IValue& value, const std::string& who, int64_t microbatch,
                             const std::string& allowed) {
  throw PipelineFailure(FailureKind::Generic, who + " returned a " + value.tagKind() + " for microbatch " +
                                                  std::to_string(microbatch) + "; " + allowed);
}

// A stage's result: one tensor, or a tuple (or list) of them.
Tensors stage_result(const c10::IValue& value, int64_t stage, int64_t microbatch) {
  const std::string who = "stage " + std::to_string(stage);
  const std::string allowed = "a pipeline stage must return a Tensor or a tuple of Tensors";
  if (value.isTensor()) return {value.toTensor()};
  if (!value.isTuple() && !value.isList()) bad_result(value, who, microbatch, allowed);
  Tensors tensors;
  for (const auto& element : value.isTuple() ? value.toTupleRef().elements().vec() : value.toListRef().vec()) {
    if (!element.isTensor()) bad_result(element, who + " (in its tuple)", microbatch, allowed);
    tensors.push_back(element.toTensor());
  }
  if (tensors.empty()) bad_result(value, who + " (empty)", microbatch, allowed);
  return tensors;
}

c10::IValue detached(const c10::IValue& value) {
  if (value.isTensor()) return value.toTensor().detach();
  std::vector<c10::IValue> elements;
  for (const auto& element : value.isTuple() ? value.toTupleRef().elements().vec() : value.toListRef().vec()) {
    elements.emplace_back(element.toTensor().detach());
  }
  return c10::ivalue::Tuple::create(std::move(elements));
}

}  // namespace

Tensors ScriptStages::operator()(int64_t stage, int64_t microbatch, const Tensors& inputs) {
  auto module = modules_->stages.find(static_cast<int>(stage));
  TORCH_CHECK(module != modules_->stages.end(), "torchpp pipeline: no TorchScript module for stage ", stage);
  std::vector<c10::IValue> args(inputs.begin(), inputs.end());
  if (inputs.empty()) {  // a first stage: this step's microbatch
    TORCH_CHECK(microbatch < static_cast<int64_t>(inputs_.size()), "torchpp pipeline: stage ", stage,
                " has no input for microbatch ", microbatch);
    args.emplace_back(inputs_[microbatch]);
  }
  const c10::IValue result = module->second.forward(std::move(args));
  Tensors outputs = stage_result(result, stage, microbatch);
  if (stage % stages_per_pipeline_ != stages_per_pipeline_ - 1) {
    return outputs;
  }
  auto expected = expected_outputs_.find(static_cast<int>(stage));
  if (expected != expected_outputs_.end()) {
    check_expected(MessageMeta::of(outputs), expected->second, stage, microbatch, "returned", "", "output_args");
  }
  if (modules_->loss && targets_.empty()) {  // an evaluation step without targets: outputs only
    outputs_[microbatch] = detached(result);
    return outputs;
  }
  at::Tensor loss;
  if (modules_->loss) {
    TORCH_CHECK(microbatch < static_cast<int64_t>(targets_.size()), "torchpp pipeline: no target for microbatch ",
                microbatch);
    const c10::IValue value = modules_->loss->forward({result, targets_[microbatch]});
    if (!value.isTensor()) bad_result(value, "the loss", microbatch, "a loss must be a one-element Tensor");
    loss = value.toTensor();
  } else {
    TORCH_CHECK(outputs.size() == 1, "torchpp pipeline: without a loss_fn the last stage's output is the loss; it "
                "returned ", outputs.size(), " tensors");
    loss = outputs[0];
  }
  TORCH_CHECK(loss.numel() == 1, "the loss of microbatch ", microbatch, " must be a one-element tensor, got ",
              loss.sizes());
  losses_[microbatch] = loss.detach();
  outputs_[microbatch] = detached(result);
  // Weighted by the microbatch's share of the batch, the summed gradients are the batch's.
  return {scale_grads_ ? loss * weights_.at(microbatch) : loss};
}

}  // namespace torchpp::runtime
