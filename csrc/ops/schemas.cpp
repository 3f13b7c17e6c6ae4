// The one home of every torch.ops.torchpp schema. Kernels live beside their op family.
#include <torch/library.h>

// ---- Tensor-parallel and sequence-parallel mappings (Megatron's f/g and SP g/g-bar) ----
TORCH_LIBRARY(torchpp, m) {
  // f: identity forward, all-reduce backward.
  m.def("copy_to_tp_region(Tensor input, str group_name) -> Tensor");
  // g: all-reduce forward, identity backward.
  m.def("reduce_from_tp_region(Tensor input, str group_name) -> Tensor");
  // Keep this rank's slice along dim forward; all-gather backward.
  m.def("scatter_to_tp_region(Tensor input, str group_name, int group_size, int dim=-1) -> Tensor");
  // All-gather along dim forward; keep this rank's slice backward.
  m.def("gather_from_tp_region(Tensor input, str group_name, int group_size, int dim=-1) -> Tensor");
  // SP: keep this rank's sequence slice forward; all-gather backward.
  m.def("scatter_to_sp_region(Tensor input, str group_name, int group_size, int dim=0) -> Tensor");
  // SP g: all-gather along the sequence forward; reduce-scatter backward.
  m.def("gather_from_sp_region(Tensor input, str group_name, int group_size, int dim=0) -> Tensor");
  // SP g-bar: reduce-scatter along the sequence forward; all-gather backward.
  m.def("reduce_scatter_to_sp_region(Tensor input, str group_name, int group_size, int dim=0) -> Tensor");
}

// ---- Pipeline: split B/W linear and scatter/gather P2P ----
TORCH_LIBRARY_FRAGMENT(torchpp, m) {
  // y = x W^T + b; backward gives the input gradient now and, while the weight-gradient store
  // captures a (stage, microbatch), defers the weight/bias gradients to its W pass.
  m.def("split_bw_linear(Tensor input, Tensor weight, Tensor? bias=None) -> Tensor");
  // This TP rank's flat 1/tp_size slice of a pipeline message (the whole tensor if it does not divide).
  m.def("pp_scatter_slice(Tensor input, int tp_rank, int tp_size) -> Tensor");
  // All-gathers the received slices over the TP group back into `shape` (reshape only if unsliced).
  m.def("pp_gather_slices(Tensor slice, int[] shape, str tp_group_name, int tp_size) -> Tensor");
}
