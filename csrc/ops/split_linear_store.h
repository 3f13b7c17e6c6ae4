// The weight-gradient store of the split B/W linear: while it captures (stage, microbatch), the
// op's backward computes the input gradient at once (the I pass) and parks the weight/bias
// gradient work here; run(stage, microbatch) later performs it (the W pass).
#pragma once

#include <cstdint>
#include <functional>

#include <ATen/core/Tensor.h>

namespace torchpp::weight_grad_store {

using Deferred = std::function<void()>;

// Starts/stops deferring weight gradients under the key (stage, microbatch). Nested capture is
// an error: one I pass runs at a time.
void begin_capture(int64_t stage, int64_t microbatch);
void end_capture();
bool capturing();

// Parks work under the captured key; false (nothing parked) when no capture is active.
bool defer(Deferred work);

// Runs and drops the work parked under (stage, microbatch), in the order it was parked;
// returns how many entries ran (0 for a stage without split-B/W layers).
int64_t run(int64_t stage, int64_t microbatch);

// Number of parked entries over all keys (tests assert W really was deferred).
int64_t pending();
// Drops everything parked (after a failed step).
void clear();

// Counts work parked for `param` (the split linear's I pass calls it for weight and bias): until
// it runs, autograd's post-accumulate hooks on `param` have seen no gradient and must wait.
void note_parked(const at::Tensor& param);
int64_t parked_for(const at::Tensor& param);
// True while accumulate() runs `param`'s post-accumulate hooks, i.e. the W pass delivers.
bool in_deferred_accumulate();

// Deferred gradients of `param` go into `main_grad` (e.g. an fp32 buffer) instead of .grad.
void set_main_grad(const at::Tensor& param, const at::Tensor& main_grad);
// Adds `grad` to param's registered main_grad, else into .grad exactly as AccumulateGrad does,
// then runs param's post-accumulate-grad hooks, so hooks (DP bucketing) fire after W, not I.
void accumulate(const at::Tensor& param, const at::Tensor& grad);

}  // namespace torchpp::weight_grad_store
