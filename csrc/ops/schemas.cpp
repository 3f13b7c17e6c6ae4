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

// ---- Context parallel: attention over a sequence sharded across a group (ring / all-gather / all-to-all) ----
TORCH_LIBRARY_FRAGMENT(torchpp, m) {
  // Attention of this rank's query shard [b, hq, s_local, d] to the whole sequence, whose key/value
  // shards [b, hk, s_local, d] (hq a multiple of hk) travel around the ring; layout "zigzag" (rank r
  // holds chunks r and 2c-1-r of 2c) or "contiguous"; segment_ids [b, s_local] keep packed sequences apart;
  // window > 0: query i sees keys j > i - window (causal); sinks [hq]: one extra logit per head in
  // each softmax's denominator, attending to nothing (GPT-OSS's attention sinks); softcap > 0: scores
  // capped to softcap * tanh(s / softcap) before the softmax (Gemma 2); alibi_slopes [hq]: slope_h * (j - i)
  // added to head h's score of query i for key j, by global position (ALiBi: Bloom, MPT).
  m.def("ring_attention(Tensor query, Tensor key, Tensor value, Tensor? segment_ids, str group_name, int group_size, "
        "bool causal=True, float? scale=None, str layout=\"zigzag\", int window=0, Tensor? sinks=None, "
        "float softcap=0., Tensor? alibi_slopes=None) -> Tensor");
  // The same with keys/values all-gathered once (backward: gathered again, gradients reduce-scattered).
  m.def("all_gather_attention(Tensor query, Tensor key, Tensor value, Tensor? segment_ids, str group_name, "
        "int group_size, bool causal=True, float? scale=None, str layout=\"zigzag\", int window=0, "
        "Tensor? sinks=None, float softcap=0., Tensor? alibi_slopes=None) -> Tensor");
  // The same with heads traded for the sequence by all-to-all (DeepSpeed-Ulysses): each rank attends with
  // hq / c heads over the whole sequence; c must divide hq (key/value heads it does not divide are repeated).
  m.def("all_to_all_attention(Tensor query, Tensor key, Tensor value, Tensor? segment_ids, str group_name, "
        "int group_size, bool causal=True, float? scale=None, str layout=\"zigzag\", int window=0, "
        "Tensor? sinks=None, float softcap=0., Tensor? alibi_slopes=None) -> Tensor");
  // Hierarchical (Megatron's "a2a+p2p"): all-to-all inside groups of a consecutive cp ranks, the ring across
  // the c / a groups (cp rank = ring rank * a + all-to-all rank); a must divide hq.
  m.def("all_to_all_ring_attention(Tensor query, Tensor key, Tensor value, Tensor? segment_ids, "
        "str all_to_all_group_name, int all_to_all_size, str ring_group_name, int ring_size, bool causal=True, "
        "float? scale=None, str layout=\"zigzag\", int window=0, Tensor? sinks=None, float softcap=0., "
        "Tensor? alibi_slopes=None) -> Tensor");
  // The all-to-all modes' exchange over a group of c ranks, each the other's gradient: [b, H, s_local, ...],
  // this rank's shard of every head -> [b, H / c, c * s_local, ...], this rank's 1/c of the heads over the
  // group's chunks in sequence order (by layout), and back.
  m.def("heads_to_sequence(Tensor x, str group_name, int group_size, str layout=\"zigzag\") -> Tensor");
  m.def("sequence_to_heads(Tensor x, str group_name, int group_size, str layout=\"zigzag\") -> Tensor");
  // Ring's and all-gather's halves (without sinks): the output and log-sum-exp [b, hq, s_local] (float for 16-bit inputs) ...
  m.def("ring_attention_forward(Tensor query, Tensor key, Tensor value, Tensor? segment_ids, str group_name, "
        "int group_size, bool causal, float? scale, str layout, int window=0, float softcap=0., "
        "Tensor? alibi_slopes=None) -> (Tensor out, Tensor lse)");
  m.def("all_gather_attention_forward(Tensor query, Tensor key, Tensor value, Tensor? segment_ids, str group_name, "
        "int group_size, bool causal, float? scale, str layout, int window=0, float softcap=0., "
        "Tensor? alibi_slopes=None) -> (Tensor out, Tensor lse)");
  // ... and the gradients of query, key and value from the output's gradient.
  m.def("ring_attention_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor out, Tensor lse, "
        "Tensor? segment_ids, str group_name, int group_size, bool causal, float? scale, str layout, int window=0, "
        "float softcap=0., Tensor? alibi_slopes=None) -> (Tensor grad_query, Tensor grad_key, "
        "Tensor grad_value)");
  m.def("all_gather_attention_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor out, "
        "Tensor lse, Tensor? segment_ids, str group_name, int group_size, bool causal, float? scale, str layout, "
        "int window=0, float softcap=0., Tensor? alibi_slopes=None) -> (Tensor grad_query, Tensor grad_key, "
        "Tensor grad_value)");
}

// ---- Expert parallel: routed tokens to the ranks holding their experts (all-to-all) and back ----
TORCH_LIBRARY_FRAGMENT(torchpp, m) {
  // Where the (token, slot) pairs of expert_index [T, k] go, num_experts split evenly over the group
  // (rank r holds experts [r E/g, (r+1) E/g)). order: the kept pairs' flat indices (token * k + slot) sorted
  // by expert, token order within one; send_counts [E]: this rank's pairs per expert; recv_counts
  // [g, E/g]: each rank's pairs for this rank's experts (exchanged over the group); dropped: pairs
  // beyond an expert's capacity ceil(capacity_factor * T * k / E) of this rank's pairs (0 when None: dropless).
  m.def("moe_route(Tensor expert_index, int num_experts, str group_name, int group_size, "
        "float? capacity_factor=None) -> (Tensor order, Tensor send_counts, Tensor recv_counts, Tensor dropped)");
  // The routed pairs' rows of hidden [T, h] on their experts' ranks: [recv_counts.sum(), h], grouped by
  // local expert, source rank within one. Backward: the gradient rows back, summed per token.
  m.def("moe_dispatch(Tensor hidden, Tensor order, Tensor send_counts, Tensor recv_counts, int top_k, "
        "str group_name, int group_size) -> Tensor");
  // The experts' output rows (as moe_dispatch gave them) back to their tokens' ranks, weighted by
  // weights [T, k] and summed per token: [num_tokens, h]. Backward: gradients of the rows and weights.
  m.def("moe_combine(Tensor expert_output, Tensor weights, Tensor order, Tensor send_counts, Tensor recv_counts, "
        "int num_tokens, str group_name, int group_size) -> Tensor");
  // Their halves: moe_dispatch's backward (rows back to their tokens, summed: [num_tokens, h]) ...
  m.def("moe_undispatch(Tensor rows, Tensor order, Tensor send_counts, Tensor recv_counts, int top_k, "
        "int num_tokens, str group_name, int group_size) -> Tensor");
  // ... moe_combine's forward, with the rows as they came back to this rank [order.numel(), h] ...
  m.def("moe_combine_forward(Tensor expert_output, Tensor weights, Tensor order, Tensor send_counts, "
        "Tensor recv_counts, int num_tokens, str group_name, int group_size) -> (Tensor out, Tensor returned)");
  // ... and its backward.
  m.def("moe_combine_backward(Tensor grad_out, Tensor returned, Tensor weights, Tensor order, Tensor send_counts, "
        "Tensor recv_counts, str group_name, int group_size) -> (Tensor grad_expert_output, Tensor grad_weights)");
}
