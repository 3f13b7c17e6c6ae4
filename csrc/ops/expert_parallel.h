// Expert parallelism's data movement: routed (token, slot) pairs travel to the ranks holding their
// experts by one all-to-all with variable split sizes (the sizes exchanged first, moe_route), and
// back. Rows leave a rank sorted by expert, which is rank-major (rank r holds a contiguous block of
// experts); they arrive grouped by source rank and are regrouped by local expert, so each expert
// runs on one contiguous block.
#pragma once

#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

namespace torchpp::ep {

// Splits of the all-to-all: rows to / from each rank, from send_counts [E] or recv_counts [g, E/g].
std::vector<int64_t> rows_per_rank(const at::Tensor& counts, int64_t group_size);

// Variable all-to-all of rows (dim 0): send_rows[r] rows go to rank r, recv_rows[r] come from it.
at::Tensor exchange_rows(const at::Tensor& rows, const std::vector<int64_t>& send_rows,
                         const std::vector<int64_t>& recv_rows, const std::string& group_name, int64_t group_size,
                         const char* op_name);

// Row indices that regroup rows arriving source-major ([g, E/g] blocks of recv_counts) by local
// expert; index_select with it goes source -> expert order, index_copy back.
at::Tensor expert_major_index(const at::Tensor& recv_counts);

}  // namespace torchpp::ep
