// TorchScript stages run without Python: the executor's forward callback for ranks whose stage
// modules (and loss, on a last stage) are all TorchScript. It holds the step's microbatch
// inputs, targets and loss weights, and keeps each microbatch's loss and output for the caller.
#pragma once

#include <map>
#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include "runtime/tensor_meta.h"

namespace torch::jit {
struct Module;
}  // namespace torch::jit

namespace torchpp::runtime {

class ScriptStages {
 public:
  // `modules`: schedule stage -> its TorchScript module; `loss`: the loss module of last stages
  // (null: a last stage's output is its loss); `expected_outputs`: a last stage's output_args,
  // checked before the loss (the executor checks those of other stages).
  ScriptStages(const std::map<int, torch::jit::Module>& modules, const torch::jit::Module* loss,
               int stages_per_pipeline, bool scale_grads, std::map<int, MessageMeta> expected_outputs = {});
  ~ScriptStages();

  // This step's microbatches (inputs on first stages, targets on last) and loss weights.
  void set_step(std::vector<at::Tensor> inputs, std::vector<at::Tensor> targets, std::vector<double> weights);
  // The executor's ForwardFn: (stage, microbatch, inputs) -> outputs, or the (scaled) loss.
  Tensors operator()(int64_t stage, int64_t microbatch, const Tensors& inputs);

  // Unscaled loss and output (a tensor or a tuple of them) of each microbatch a last stage of
  // this rank ran, last step.
  const std::map<int64_t, at::Tensor>& losses() const { return losses_; }
  const std::map<int64_t, c10::IValue>& outputs() const { return outputs_; }

 private:
  struct Modules;
  std::unique_ptr<Modules> modules_;
  int stages_per_pipeline_;
  bool scale_grads_;
  std::map<int, MessageMeta> expected_outputs_;
  std::vector<at::Tensor> inputs_;
  std::vector<at::Tensor> targets_;
  std::vector<double> weights_;
  std::map<int64_t, at::Tensor> losses_;
  std::map<int64_t, c10::IValue> outputs_;
};

}  // namespace torchpp::runtime
