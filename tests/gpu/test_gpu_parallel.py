"""Model-level parallelism on the GPU over NCCL, float32 against the unwrapped model in one
process on the same GPU (torchpp.testing checks, rtol 1e-5): context parallelism at cp=2 (ring,
all-gather, all-to-all and all-to-all+ring attention, both layouts; sparse indexed and compressed
attention), expert parallelism at ep=2 (Mixtral), ZeRO-3 at dp=2,
a DCP checkpoint saved at tp=2 that reloads at tp=1 x dp=2 and continues the same run, and
destroy_parallel freeing NCCL layouts."""
import torch

from test_hf_checkpoint import _dcp_steps
from torchpp.testing.expert_checks import check_ep
from torchpp.testing.model_checks import check_cp

TIMEOUT_S = 300
F32 = dict(dtype=torch.float32)


def check_context_parallel():
    # DeepSeek-V3.2's sparse attention and DeepSeek-V4's compressed entries over gathered keys: SDPA
    # with a boolean mask (sinks as an extra key) on CUDA's kernels.
    return [check_cp("llama", **F32), check_cp("llama", mode="all-gather", layout="contiguous", **F32),
            check_cp("llama", mode="all-to-all", packed=True, **F32),
            check_cp("llama", mode="all-to-all+ring", all_to_all_size=2, layout="contiguous", **F32),
            check_cp("deepseek_v32", **F32), check_cp("deepseek_v4", index_topk=3, **F32)]


def test_llama_cp2(gpu_ranks):
    assert all(gpu_ranks(2).run(check_context_parallel, timeout=TIMEOUT_S))


def test_mixtral_ep2(gpu_ranks):
    assert all(gpu_ranks(2).run(check_ep, "mixtral", ep=2, **F32, timeout=TIMEOUT_S))


def test_llama_zero3_dp2(gpu_ranks):
    assert all(gpu_ranks(2).run(check_cp, "llama", cp=1, dp=2, zero=3, **F32, timeout=TIMEOUT_S))


def test_dcp_save_at_tp2_reload_at_dp2(gpu_ranks, tmp_path):
    root = str(tmp_path / "ckpt")
    saved = gpu_ranks(2).run(_dcp_steps, "llama", 2, 2, root, save_after=True, **F32, timeout=TIMEOUT_S)
    loaded = gpu_ranks(2).run(_dcp_steps, "llama", 2, 1, root, load=True, **F32, timeout=TIMEOUT_S)
    # The second step after loading gives the uninterrupted run's loss (float32: tp=2 and dp=2
    # sum in other orders).
    assert abs(loaded[0] - saved[0]) <= 1e-5 * abs(saved[0]), (saved, loaded)
    other = gpu_ranks(2).run(_dcp_steps, "llama", 2, 1, root, load=True, restore=False, **F32, timeout=TIMEOUT_S)
    assert abs(other[0] - saved[0]) > 1e-4 * abs(saved[0]), "the load changed nothing the test can see"


def test_destroy_parallel_frees_nccl_layouts(gpu_ranks, device):
    from test_destroy_parallel import check_layouts_free_their_groups

    gpu_ranks(2).run(check_layouts_free_their_groups, 4, device.type, timeout=TIMEOUT_S)
