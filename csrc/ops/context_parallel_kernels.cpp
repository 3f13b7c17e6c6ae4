// Context-parallel blocks on ATen's fused attention kernels, which return the log-sum-exp the
// merge needs and never hold a block's [sq, sk] scores: memory O(s) per block. Device-generic:
// the kernels are reached through the dispatcher, so no CUDA header is included here.
//
// Scores capped by a softcap or biased by ALiBi take the matmul path (no fused kernel reached here does either).
//
// Masks: ring blocks (zigzag or contiguous) and the all-gather's split prefix are all-visible,
// empty (skipped before this point) or the square diagonal block, whose causal mask is the
// kernels' own (top-left and bottom-right alignment agree when sq == sk). Anything else (packed
// sequences' segment masks) takes the matmul path.
#include <cstdlib>
#include <cstring>

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/SDPBackend.h>
#include <ATen/record_function.h>

#include "ops/context_parallel.h"

namespace torchpp::cp {
namespace {

// [b, hk, g * n, ...] <-> [b, hq, n, ...]: the same memory (head h uses key/value head h / g).
at::Tensor per_head(const at::Tensor& grouped, const Shapes& shapes) {
  auto sizes = grouped.sizes().vec();
  sizes[1] = shapes.q_heads;
  sizes[2] /= shapes.groups;
  return grouped.reshape(sizes);
}

at::Tensor grouped(const at::Tensor& per_head_tensor, const Shapes& shapes) {
  auto sizes = per_head_tensor.sizes().vec();
  sizes[1] = shapes.kv_heads;
  sizes[2] *= shapes.groups;
  return per_head_tensor.reshape(sizes);
}

// Key/value heads repeated for each query head: for the kernel that lacks grouped-query attention.
at::Tensor repeat_heads(const at::Tensor& kv, const Shapes& shapes) {
  if (shapes.groups == 1) {
    return kv;
  }
  return kv.repeat_interleave(shapes.groups, 1);
}

// Gradient of repeated key/value heads summed back per key/value head.
at::Tensor sum_heads(const at::Tensor& grad, const Shapes& shapes) {
  if (shapes.groups == 1) {
    return grad;
  }
  return grad.unflatten(1, {shapes.kv_heads, shapes.groups}).sum(2);
}

// Read per call (a getenv is cheap next to a block), so a benchmark can compare the paths.
bool kernel_forced(const char* name) {
  const char* value = std::getenv("TORCHPP_CP_KERNEL");
  return value != nullptr && std::strcmp(value, name) == 0;
}

// What SDPA would run for these shapes (honours torch.backends.cuda.enable_*_sdp), or math when
// it names none (e.g. every fused backend disabled by the caller).
at::SDPBackend sdpa_choice(const at::Tensor& q, const at::Tensor& k, bool causal, bool gqa, double scale) {
  try {
    return static_cast<at::SDPBackend>(at::_fused_sdp_choice(q, k, k, std::nullopt, 0.0, causal, scale, gqa));
  } catch (const c10::Error&) {
    return at::SDPBackend::math;
  }
}

// Key heads as many as the query heads, all aliasing the first: a stand-in for asking whether
// the memory-efficient kernel (no grouped-query attention: we repeat the heads) takes the block.
at::Tensor as_if_repeated(const at::Tensor& k, int64_t q_heads) {
  return k.as_strided({k.size(0), q_heads, k.size(2), k.size(3)}, {k.stride(0), 0, k.stride(2), k.stride(3)});
}

// The log-sum-exp as the memory-efficient forward returns it: float, rows padded to a multiple of
// 32 (its backward checks the head stride's alignment).
at::Tensor padded_lse(const at::Tensor& lse) {
  const int64_t rows = lse.size(2), padded = (rows + 31) / 32 * 32;
  auto out = at::zeros({lse.size(0), lse.size(1), padded}, lse.options().dtype(at::kFloat));
  out.narrow(2, 0, rows).copy_(lse);
  return out;
}

// A block cuDNN refuses (a configuration its graph cannot build) runs on flash, which takes the
// same merged statistics: said once, with cuDNN's reason, rather than failing the step.
void warn_cudnn_declined(const c10::Error& error) {
  TORCH_WARN_ONCE("torchpp: cuDNN attention declined a context-parallel block (", error.what_without_backtrace(),
                  "); such blocks run on flash attention (TORCHPP_CP_KERNEL=flash chooses it up front)");
}

bool flash_takes(const at::Tensor& q, const Shapes& shapes) {
  // The flash kernel wants fp16/bf16 and head sizes a multiple of 8 up to 256 (SDPA pads them; we would copy).
  const auto dtype = q.scalar_type();
  return (dtype == at::kHalf || dtype == at::kBFloat16) && shapes.head_dim % 8 == 0 && shapes.head_dim <= 256 &&
         at::globalContext().userEnabledFlashSDP();
}

}  // namespace

const char* kernel_name(BlockKernel kernel) {
  switch (kernel) {
    case BlockKernel::FlashCpu:
      return "flash_cpu";
    case BlockKernel::Cudnn:
      return "cudnn";
    case BlockKernel::Flash:
      return "flash";
    case BlockKernel::Efficient:
      return "efficient";
    case BlockKernel::Matmul:
      break;
  }
  return "matmul";
}

BlockKernel choose_kernel(const at::Tensor& q, const at::Tensor& k, const BlockMask& mask, const Shapes& shapes) {
  if (mask.allowed.defined() || shapes.softcap > 0 || shapes.alibi.defined() || kernel_forced("matmul")) {
    return BlockKernel::Matmul;  // a mask the kernels cannot take without an [sq, sk] tensor, capped or biased scores
  }
  const auto q_heads = per_head(q, shapes);
  const bool gqa = shapes.groups > 1;
  auto choice = sdpa_choice(q_heads, k, mask.causal, gqa, shapes.scale);
  if (q.device().is_cpu()) {
    return choice == at::SDPBackend::flash_attention ? BlockKernel::FlashCpu : BlockKernel::Matmul;
  }
  if (choice == at::SDPBackend::math && gqa) {  // SDPA's grouped-query rule; we repeat the heads for efficient
    choice = sdpa_choice(q_heads, as_if_repeated(k, shapes.q_heads), mask.causal, false, shapes.scale);
  }
  switch (choice) {
    case at::SDPBackend::flash_attention:
      return shapes.head_dim % 8 == 0 ? BlockKernel::Flash : BlockKernel::Efficient;
    case at::SDPBackend::cudnn_attention:
      // SDPA's first choice on Hopper. Its dense backward takes one head count for queries and keys:
      // grouped-query blocks (and TORCHPP_CP_KERNEL=flash) run on flash or memory-efficient attention.
      if (!gqa && !kernel_forced("flash")) {
        return BlockKernel::Cudnn;
      }
      if (flash_takes(q, shapes)) {
        return BlockKernel::Flash;
      }
      return at::globalContext().userEnabledMemEfficientSDP() ? BlockKernel::Efficient : BlockKernel::Matmul;
    case at::SDPBackend::efficient_attention:
      return BlockKernel::Efficient;  // fp32, or what flash declines
    default:
      return BlockKernel::Matmul;  // fp64 on CUDA has no fused kernel
  }
}

std::pair<at::Tensor, at::Tensor> fused_block_forward(BlockKernel kernel, const at::Tensor& q, const at::Tensor& k,
                                                      const at::Tensor& v, bool causal, const Shapes& shapes) {
  RECORD_FUNCTION("torchpp::cp_block", std::vector<c10::IValue>());
  const auto q_heads = per_head(q, shapes);
  at::Tensor out, lse;
  switch (kernel) {
    case BlockKernel::FlashCpu:
      std::tie(out, lse) = at::_scaled_dot_product_flash_attention_for_cpu(q_heads, k, v, 0.0, causal, std::nullopt,
                                                                           shapes.scale);
      break;
    case BlockKernel::Cudnn:
      try {
        auto result = at::_scaled_dot_product_cudnn_attention(q_heads, k, v, std::nullopt,
                                                              /*compute_log_sumexp=*/true, 0.0, causal, false,
                                                              shapes.scale);
        out = std::get<0>(result);
        lse = std::get<1>(result).reshape(q_heads.sizes().slice(0, 3));  // cuDNN's [b, h, s, 1] statistics
        break;
      } catch (const c10::Error& error) {
        warn_cudnn_declined(error);
      }
      [[fallthrough]];
    case BlockKernel::Flash: {
      auto result = at::_scaled_dot_product_flash_attention(q_heads, k, v, 0.0, causal, false, shapes.scale);
      out = std::get<0>(result);
      lse = std::get<1>(result);
      break;
    }
    case BlockKernel::Efficient: {
      auto result = at::_scaled_dot_product_efficient_attention(q_heads, repeat_heads(k, shapes),
                                                                repeat_heads(v, shapes), std::nullopt,
                                                                /*compute_log_sumexp=*/true, 0.0, causal, shapes.scale);
      out = std::get<0>(result);
      lse = std::get<1>(result).narrow(2, 0, q_heads.size(2));  // padded to a multiple of 32 rows
      break;
    }
    case BlockKernel::Matmul:
      TORCH_INTERNAL_ASSERT(false, "fused_block_forward called for the matmul path");
  }
  // The output stays in the kernel's dtype (it rounded it there): merge_block widens it only where a
  // second block joins, so a piece that sees one block never holds an fp32 copy.
  return {grouped(out, shapes), grouped(lse.to(shapes.acc_dtype), shapes)};
}

void fused_block_backward(BlockKernel kernel, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const at::Tensor& dout, const at::Tensor& out, const at::Tensor& lse, bool causal,
                          const Shapes& shapes, at::Tensor& dq, at::Tensor& dk, at::Tensor& dv) {
  RECORD_FUNCTION("torchpp::cp_block_backward", std::vector<c10::IValue>());
  const auto q_heads = per_head(q, shapes), dout_heads = per_head(dout, shapes), out_heads = per_head(out, shapes);
  // The merged log-sum-exp, not the block's: the kernel's P = exp(S - lse) is this block's share.
  const auto lse_heads = per_head(lse, shapes).contiguous();
  at::Tensor dq_block, dk_block, dv_block;
  switch (kernel) {
    case BlockKernel::FlashCpu:
      std::tie(dq_block, dk_block, dv_block) = at::_scaled_dot_product_flash_attention_for_cpu_backward(
          dout_heads, q_heads, k, v, out_heads, lse_heads, 0.0, causal, std::nullopt, shapes.scale);
      break;
    case BlockKernel::Cudnn:
      try {
        // Without dropout the kernel never reads its random-number state; the statistics go back in
        // the [b, h, s, 1] layout its forward made them in.
        const auto no_rng = at::empty({1}, q.options().dtype(at::kLong));
        std::tie(dq_block, dk_block, dv_block) = at::_scaled_dot_product_cudnn_attention_backward(
            dout_heads, q_heads, k, v, out_heads, lse_heads.to(at::kFloat).unsqueeze(-1), no_rng, no_rng,
            at::Tensor(), at::Tensor(), at::Tensor(), q_heads.size(2), k.size(2), 0.0, causal, shapes.scale);
        break;
      } catch (const c10::Error& error) {
        warn_cudnn_declined(error);
      }
      [[fallthrough]];
    case BlockKernel::Flash: {
      // Without dropout the kernel never reads its random-number state.
      const auto no_rng = at::empty({2}, q.options().dtype(at::kLong));
      std::tie(dq_block, dk_block, dv_block) = at::_scaled_dot_product_flash_attention_backward(
          dout_heads, q_heads, k, v, out_heads, lse_heads.to(at::kFloat), at::Tensor(), at::Tensor(),
          q_heads.size(2), k.size(2), 0.0, causal, no_rng, no_rng, shapes.scale);
      break;
    }
    case BlockKernel::Efficient: {
      const auto no_rng = at::empty({2}, q.options().dtype(at::kLong));
      auto result = at::_scaled_dot_product_efficient_attention_backward(
          dout_heads, q_heads, repeat_heads(k, shapes), repeat_heads(v, shapes), at::Tensor(), out_heads,
          padded_lse(lse_heads), no_rng, no_rng, 0.0, {true, true, true, false}, causal, shapes.scale);
      dq_block = std::get<0>(result);
      dk_block = sum_heads(std::get<1>(result), shapes);
      dv_block = sum_heads(std::get<2>(result), shapes);
      break;
    }
    case BlockKernel::Matmul:
      TORCH_INTERNAL_ASSERT(false, "fused_block_backward called for the matmul path");
  }
  accumulate_grad(dq, grouped(dq_block, shapes), shapes.acc_dtype);
  accumulate_grad(dk, dk_block, shapes.acc_dtype);
  accumulate_grad(dv, dv_block, shapes.acc_dtype);
}

}  // namespace torchpp::cp
