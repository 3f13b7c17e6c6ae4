#include "ops/p2p.h"

#include <ATen/ATen.h>
#include <c10/core/SymBool.h>
#include <c10/util/irange.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/library.h>

#include "ops/collectives.h"
#include "ops/process_group.h"

namespace torchpp::p2p {

int64_t sent_numel(int64_t numel, int64_t tp_size) {
  return (tp_size > 1 && numel % tp_size == 0) ? numel / tp_size : numel;
}

at::Tensor scatter_slice(const at::Tensor& full, int64_t tp_rank, int64_t tp_size) {
  TORCH_CHECK(tp_rank >= 0 && tp_rank < tp_size, "torchpp.pp_scatter_slice: tp_rank ", tp_rank,
              " outside [0, ", tp_size, ")");
  const auto flat = full.contiguous().view({-1});
  // Symbolic sizes: the fake kernel is this one, run on torch.compile's fake tensors (sent_numel's rule).
  const c10::SymInt numel = flat.sym_numel();
  if (tp_size == 1 || !(numel % tp_size).sym_eq(0).guard_bool(__FILE__, __LINE__)) {
    return flat;
  }
  // contiguous(): gloo and NCCL send dense buffers; the narrow view of a flat tensor already is.
  const c10::SymInt count = numel / tp_size;
  return flat.narrow_symint(0, count * tp_rank, count);
}

at::Tensor gather_slices(const at::Tensor& slice, c10::IntArrayRef shape, const std::string& tp_group_name,
                         int64_t tp_size, std::chrono::milliseconds timeout) {
  const int64_t numel = c10::multiply_integers(shape);
  if (slice.numel() == numel) {
    return slice.view(shape);
  }
  TORCH_CHECK(slice.numel() * tp_size == numel, "torchpp.pp_gather_slices: a slice of ", slice.numel(),
              " elements times tp_size ", tp_size, " does not make a tensor of shape ", shape);
  return all_gather_along(slice.view({-1}), 0, tp_group_name, tp_size, "pp_gather_slices", timeout).view(shape);
}

namespace {

at::Tensor pp_scatter_slice(const at::Tensor& input, int64_t tp_rank, int64_t tp_size) {
  // A fresh tensor: custom ops may not alias their inputs.
  return scatter_slice(input, tp_rank, tp_size).clone();
}

at::Tensor pp_gather_slices(const at::Tensor& slice, c10::IntArrayRef shape, c10::string_view tp_group_name,
                            int64_t tp_size) {
  // A name that resolves to no group is an error even where this message needs no all-gather.
  resolve_group(std::string(tp_group_name));
  return gather_slices(slice, shape, std::string(tp_group_name), tp_size).clone();
}

// The rebuilt tensor's shape, for fake tensors: no group is touched.
at::Tensor pp_gather_slices_fake(const at::Tensor& slice, c10::IntArrayRef shape, c10::string_view, int64_t tp_size) {
  const int64_t numel = c10::multiply_integers(shape);
  TORCH_SYM_CHECK(slice.sym_numel().sym_eq(numel).sym_or((slice.sym_numel() * tp_size).sym_eq(numel)),
                  "torchpp.pp_gather_slices: a slice of ", slice.sym_numel(), " elements (times tp_size ", tp_size,
                  " or not) does not make a tensor of shape ", shape);
  return at::empty(shape, slice.options());
}

}  // namespace

// ---- Device-generic kernels ----
TORCH_LIBRARY_IMPL(torchpp, CompositeExplicitAutograd, m) {
  m.impl("pp_scatter_slice", TORCH_FN(pp_scatter_slice));
  m.impl("pp_gather_slices", TORCH_FN(pp_gather_slices));
}

// Fake kernels: pp_scatter_slice's is its own (symbolic sizes); pp_gather_slices' touches no group.
TORCH_LIBRARY_IMPL(torchpp, Meta, m) {
  m.impl("pp_gather_slices", TORCH_FN(pp_gather_slices_fake));
}

}  // namespace torchpp::p2p
