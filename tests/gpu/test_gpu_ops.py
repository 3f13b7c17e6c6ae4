"""torch.ops.torchpp on CUDA tensors over NCCL: every TP/SP mapping (exact, integer-valued
floats, as on the CPU), expert dispatch/combine at ep=2 (float64 against the CPU reference),
context-parallel attention at cp=2 in each mode and layout on each block kernel (float64:
matmul; float32: memory-efficient; bfloat16: flash; against float64 SDPA, bf16 looser as its
kernels round P to 8 bits) with a profile showing that kernel ran (SDPA itself would pick cuDNN
attention on Hopper), each mode under torch.compile, and the split-B/W linear under autocast (bf16, fp16) computing as
autocast's own linear."""
import pytest
import torch

from test_context_parallel_attention import HEADS, _inputs, _kernels_used, check_all_cases, check_compiled_cases
from test_moe_dispatch import check_dispatch_combine
from test_tp_mappings import check_all_mappings
from torchpp.pipeline import SplitBWLinear, weight_grad_store

TIMEOUT_S = 240


@pytest.mark.parametrize("world_size", [2, 4])
def test_tp_sp_mappings(gpu_ranks, device, world_size):
    dtypes = (torch.float32, torch.bfloat16, torch.float64)
    assert gpu_ranks(world_size).run(check_all_mappings, device, dtypes, timeout=TIMEOUT_S) == [True] * world_size


@pytest.mark.parametrize("routing", ["random", "one_rank"])
def test_expert_dispatch_combine_ep2(gpu_ranks, device, routing):
    assert len(gpu_ranks(2).run(check_dispatch_combine, 4, routing, device=device, timeout=TIMEOUT_S)) == 2


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
def test_context_parallel_attention_cp2(gpu_ranks, device, dtype):
    assert gpu_ranks(2).run(check_all_cases, 16, device, dtype, timeout=TIMEOUT_S) == [True, True]


def test_context_parallel_attention_compiled_cp2(gpu_ranks, device):
    # Each mode traced whole (aot_eager: the graph's ops run on CUDA over NCCL, no triton build).
    assert gpu_ranks(2).run(check_compiled_cases, 16, device, torch.float32, timeout=TIMEOUT_S) == [True, True]

def sdpa_picks_cudnn(device, dtype) -> bool:
    """Whether SDPA would run cuDNN attention on a block of check_block_kernel's ring (4 tokens)."""
    q, k, _, _ = (t.to(device, dtype)[:, :, :4] for t in _inputs(16, kv_heads=HEADS))
    return torch._fused_sdp_choice(q, k, k, is_causal=True) == torch.nn.attention.SDPBackend.CUDNN_ATTENTION.value


def check_block_kernel(device, dtype, kernel, kv_heads=2):
    used = _kernels_used(False, kernel or "flash", device, dtype, kv_heads=kv_heads)
    q, k, _, _ = (t.to(device, dtype) for t in _inputs(8, kv_heads=kv_heads))
    choice = torch._fused_sdp_choice(q, k, k, is_causal=True, enable_gqa=kv_heads < HEADS)  # for the message
    if kernel is None:
        assert sum(used.values()) == 0, f"{dtype}: a fused kernel ran where none takes it: {used}"
    else:
        assert used[""] > 0 and used["_backward"] > 0, (f"{dtype}: the blocks did not run {kernel} attention "
                                                        f"(counts {used}; SDPA's choice {choice})")
    return used


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64], ids=str)
def test_context_parallel_blocks_run_fused_kernels(gpu_ranks, device, dtype):
    if device.type == "cpu":
        kernel = "flash_cpu"
    else:
        kernel = {torch.bfloat16: "flash", torch.float32: "efficient", torch.float64: None}[dtype]
    assert len(gpu_ranks(2).run(check_block_kernel, device, dtype, kernel, timeout=TIMEOUT_S)) == 2


def test_context_parallel_blocks_take_sdpa_cudnn_choice(gpu_ranks, device):
    """bf16 blocks without grouped-query heads run the kernel SDPA picks: cuDNN attention on Hopper
    (its [b, h, s, 1] statistics merged and handed back to its backward), flash elsewhere."""
    if device.type == "cpu":
        pytest.skip("CUDA kernels: the CPU blocks run the CPU flash kernel (test_context_parallel_attention.py)")
    kernel = "cudnn" if sdpa_picks_cudnn(device, torch.bfloat16) else "flash"
    assert len(gpu_ranks(2).run(check_block_kernel, device, torch.bfloat16, kernel, HEADS, timeout=TIMEOUT_S)) == 2


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16"])
@pytest.mark.parametrize("deferred", [False, True])
def test_split_bw_linear_under_autocast(device, dtype_name, deferred):
    if device.type == "cpu" and dtype_name == "float16":
        pytest.skip("CPU autocast runs bfloat16 only")
    low = getattr(torch, dtype_name)
    torch.manual_seed(0)
    layer, reference = SplitBWLinear(64, 32).to(device), torch.nn.Linear(64, 32).to(device)
    reference.load_state_dict(layer.state_dict())
    x = torch.randn(16, 64, device=device)
    with torch.autocast(device.type, dtype=low):
        out, want = layer(x), reference(x)
    assert out.dtype == low and torch.equal(out, want), "the op's forward is not autocast's linear"
    grad = torch.randn(16, 32, device=device).to(low)
    if deferred:
        with weight_grad_store.capture(0, 0):
            out.backward(grad)
        assert layer.weight.grad is None
        assert weight_grad_store.run(0, 0) == 1
    else:
        out.backward(grad)
    want.backward(grad)
    for got, expected in [(layer.weight, reference.weight), (layer.bias, reference.bias)]:
        assert got.grad.dtype == torch.float32
        torch.testing.assert_close(got.grad, expected.grad, rtol=0, atol=0)
