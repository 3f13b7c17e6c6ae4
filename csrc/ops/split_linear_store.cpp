#include "ops/split_linear_store.h"

#include <map>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/autograd/variable.h>

namespace torchpp::weight_grad_store {
namespace {

using Key = std::pair<int64_t, int64_t>;

// A parameter's main_grad, held with a weak reference to the parameter: a dead parameter's
// address can be reused by a new tensor, which must not inherit its main_grad.
struct MainGrad {
  c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl> owner;
  at::Tensor buffer;
};

// Global, not thread-local: on accelerators the autograd engine runs backward on device threads.
struct Store {
  std::mutex mutex;
  bool capturing = false;
  Key key{-1, -1};
  std::map<Key, std::vector<Deferred>> parked;
  std::unordered_map<const c10::TensorImpl*, MainGrad> main_grads;
  std::unordered_map<const c10::TensorImpl*, int64_t> parked_per_param;
};

thread_local bool delivering = false;

struct DeliveringGuard {
  DeliveringGuard() { delivering = true; }
  ~DeliveringGuard() { delivering = false; }
};

Store& store() {
  static Store instance;
  return instance;
}

}  // namespace

void begin_capture(int64_t stage, int64_t microbatch) {
  auto& s = store();
  std::lock_guard<std::mutex> lock(s.mutex);
  TORCH_CHECK(!s.capturing, "torchpp weight-gradient store: already capturing stage ", s.key.first,
              " microbatch ", s.key.second, "; cannot start stage ", stage, " microbatch ", microbatch);
  s.capturing = true;
  s.key = {stage, microbatch};
}

void end_capture() {
  auto& s = store();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.capturing = false;
}

bool capturing() {
  auto& s = store();
  std::lock_guard<std::mutex> lock(s.mutex);
  return s.capturing;
}

bool defer(Deferred work) {
  auto& s = store();
  std::lock_guard<std::mutex> lock(s.mutex);
  if (!s.capturing) {
    return false;
  }
  s.parked[s.key].push_back(std::move(work));
  return true;
}

int64_t run(int64_t stage, int64_t microbatch) {
  std::vector<Deferred> work;
  {
    auto& s = store();
    std::lock_guard<std::mutex> lock(s.mutex);
    auto it = s.parked.find({stage, microbatch});
    if (it == s.parked.end()) {
      return 0;
    }
    work = std::move(it->second);
    s.parked.erase(it);
  }
  for (auto& fn : work) {
    fn();
  }
  return static_cast<int64_t>(work.size());
}

int64_t pending() {
  auto& s = store();
  std::lock_guard<std::mutex> lock(s.mutex);
  int64_t count = 0;
  for (const auto& entry : s.parked) {
    count += static_cast<int64_t>(entry.second.size());
  }
  return count;
}

void clear() {
  auto& s = store();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.parked.clear();
  s.parked_per_param.clear();
  s.capturing = false;
}

void note_parked(const at::Tensor& param) {
  auto& s = store();
  std::lock_guard<std::mutex> lock(s.mutex);
  ++s.parked_per_param[param.unsafeGetTensorImpl()];
}

int64_t parked_for(const at::Tensor& param) {
  auto& s = store();
  std::lock_guard<std::mutex> lock(s.mutex);
  auto it = s.parked_per_param.find(param.unsafeGetTensorImpl());
  return it == s.parked_per_param.end() ? 0 : it->second;
}

bool in_deferred_accumulate() {
  return delivering;
}

void set_main_grad(const at::Tensor& param, const at::Tensor& main_grad) {
  TORCH_CHECK(param.sizes() == main_grad.sizes(), "torchpp: main_grad of shape ", main_grad.sizes(),
              " does not match its parameter of shape ", param.sizes());
  auto& s = store();
  std::lock_guard<std::mutex> lock(s.mutex);
  MainGrad entry{c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>(param.getIntrusivePtr()),
                 main_grad};
  s.main_grads.insert_or_assign(param.unsafeGetTensorImpl(), std::move(entry));
}

void accumulate(const at::Tensor& param, const at::Tensor& grad) {
  at::NoGradGuard no_grad;
  at::Tensor main_grad;
  {
    auto& s = store();
    std::lock_guard<std::mutex> lock(s.mutex);
    auto it = s.main_grads.find(param.unsafeGetTensorImpl());
    if (it != s.main_grads.end()) {
      if (it->second.owner.expired()) {
        s.main_grads.erase(it);  // registered for a parameter that died at this address
      } else {
        main_grad = it->second.buffer;
      }
    }
  }
  if (main_grad.defined()) {
    main_grad.add_(grad.to(main_grad.scalar_type()));
  } else {
    // AccumulateGrad's arithmetic, after autograd's cast to the parameter's dtype (a gradient
    // computed under autocast is in the compute dtype): the first is taken as is, later ones added.
    const auto cast = grad.to(param.scalar_type());
    at::Tensor& slot = const_cast<at::Tensor&>(param).mutable_grad();
    if (!slot.defined()) {
      slot = cast.detach();
    } else {
      slot.add_(cast);
    }
  }
  {
    auto& s = store();
    std::lock_guard<std::mutex> lock(s.mutex);
    auto it = s.parked_per_param.find(param.unsafeGetTensorImpl());
    if (it != s.parked_per_param.end() && --it->second <= 0) {
      s.parked_per_param.erase(it);
    }
  }
  auto& hook = torch::autograd::impl::post_acc_grad_hooks(param);
  if (hook) {
    DeliveringGuard guard;
    (*hook)(param);
  }
}

}  // namespace torchpp::weight_grad_store
