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

// ---- Context parallel: attention over a sequence sharded across a group (ring / all-gather) ----
TORCH_LIBRARY_FRAGMENT(torchpp, m) {
  // Attention of this rank's query shard [b, hq, s_local, d] to the whole sequence, whose key/value
  // shards [b, hk, s_local, d] (hq a multiple of hk) travel around the ring; layout "zigzag" (rank r
  // holds chunks r and 2c-1-r of 2c) or "contiguous"; segment_ids [b, s_local] keep packed sequences apart.
  m.def("ring_attention(Tensor query, Tensor key, Tensor value, Tensor? segment_ids, str group_name, int group_size, "
        "bool causal=True, float? scale=None, str layout=\"zigzag\") -> Tensor");
  // The same with keys/values all-gathered once (backward: gathered again, gradients reduce-scattered).
  m.def("all_gather_attention(Tensor query, Tensor key, Tensor value, Tensor? segment_ids, str group_name, "
        "int group_size, bool causal=True, float? scale=None, str layout=\"zigzag\") -> Tensor");
  // Their halves: the output and log-sum-exp [b, hq, s_local] (float for 16-bit inputs) ...
  m.def("ring_attention_forward(Tensor query, Tensor key, Tensor value, Tensor? segment_ids, str group_name, "
        "int group_size, bool causal, float? scale, str layout) -> (Tensor out, Tensor lse)");
  m.def("all_gather_attention_forward(Tensor query, Tensor key, Tensor value, Tensor? segment_ids, str group_name, "
        "int group_size, bool causal, float? scale, str layout) -> (Tensor out, Tensor lse)");
  // ... and the gradients of query, key and value from the output's gradient.
  m.def("ring_attention_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor out, Tensor lse, "
        "Tensor? segment_ids, str group_name, int group_size, bool causal, float? scale, str layout) "
        "-> (Tensor grad_query, Tensor grad_key, Tensor grad_value)");
  m.def("all_gather_attention_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor out, "
        "Tensor lse, Tensor? segment_ids, str group_name, int group_size, bool causal, float? scale, str layout) "
        "-> (Tensor grad_query, Tensor grad_key, Tensor grad_value)");
}
