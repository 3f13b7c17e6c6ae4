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
                           int stages_per_pipeline, bool scale_grads)
    : modules_(std::make_unique<Modules>()), stages_per_pipeline_(stages_per_pipeline), scale_grads_(scale_grads) {
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

at::Tensor tensor_result(const c10::IValue& value, const std::string& who, int64_t microbatch) {
  if (!value.isTensor()) {
    throw PipelineFailure(FailureKind::Generic, who + " returned a " + value.tagKind() + " for microbatch " +
                                                    std::to_string(microbatch) + "; a pipeline stage must return one Tensor");
  }
  return value.toTensor();
}

}  // namespace

at::Tensor ScriptStages::operator()(int64_t stage, int64_t microbatch, const at::Tensor& input) {
  auto module = modules_->stages.find(static_cast<int>(stage));
  TORCH_CHECK(module != modules_->stages.end(), "torchpp pipeline: no TorchScript module for stage ", stage);
  at::Tensor x = input;
  if (!x.defined()) {
    TORCH_CHECK(microbatch < static_cast<int64_t>(inputs_.size()), "torchpp pipeline: stage ", stage,
                " has no input for microbatch ", microbatch);
    x = inputs_[microbatch];
  }
  at::Tensor output = tensor_result(module->second.forward({x}), "stage " + std::to_string(stage), microbatch);
  if (stage % stages_per_pipeline_ != stages_per_pipeline_ - 1) {
    return output;
  }
  at::Tensor loss = output;
  if (modules_->loss && targets_.empty()) {  // an evaluation step without targets: outputs only
    outputs_[microbatch] = output.detach();
    return output;
  }
  if (modules_->loss) {
    TORCH_CHECK(microbatch < static_cast<int64_t>(targets_.size()), "torchpp pipeline: no target for microbatch ",
                microbatch);
    loss = tensor_result(modules_->loss->forward({output, targets_[microbatch]}), "the loss", microbatch);
  }
  TORCH_CHECK(loss.numel() == 1, "the loss of microbatch ", microbatch, " must be a one-element tensor, got ",
              loss.sizes());
  losses_[microbatch] = loss.detach();
  outputs_[microbatch] = output.detach();
  // Weighted by the microbatch's share of the batch, the summed gradients are the batch's.
  return scale_grads_ ? loss * weights_.at(microbatch) : loss;
}

}  // namespace torchpp::runtime
