"""Mamba mixers under tensor parallelism (torchpp's family plans, ``torchpp.models.mamba_plans``):
channels split as Megatron splits them. Mamba: x_proj's row split summed forward and, since the
per-channel scan reads dt, B and C back, its output gradient summed too (``rowwise_copy_output``);
the depthwise conv on this rank's channels (``conv_channels``). Mamba 2: in_proj's five fused blocks
and the conv's three split block by block, whole groups of heads per rank. Mamba, Falcon-Mamba and
Mamba 2 at tp=2 (and, under plan="auto", the Mamba 2 mixers of Nemotron-H, Bamba, Granite hybrid
and Zamba 2, Jamba's Mamba 1 mixers, whose norms on dt, B and C take their gradients summed
over TP, and Zamba's, whose heads hold their own x_proj and dt_proj). Fewer groups of heads than ranks (n_groups=1 in Bamba, Granite and Zamba 2; Mamba 2 with
1 or 2 groups at tp=4, Falcon-H1 with 2 at tp=4): each rank holds its heads' group of B and C, copied, their gradient rows
summed over the copies, and the gated norm's statistics summed over the ranks sharing a group.
Mamba, Mamba 2, Jamba and Bamba at tp=2 x pp=2 under zb-h1 (weight gradients deferred to W), in
float64 against the unwrapped model: loss, logits, every gradient, one SGD step
(torchpp.testing.model_checks)."""
import pytest
import torch
from torch import nn

from torchpp.models.mamba_plans import mamba2_plan, refuse_fused_kernel
from torchpp.tensor_parallel.styles import STYLES, PlanError
from torchpp.testing.model_checks import check_pp, check_tp
from torchpp.testing.tiny_models import tiny_model

TIMEOUT_S = 240


def _tp_checks():
    return [check_tp("mamba"), check_tp("falcon_mamba", plan="auto"), check_tp("mamba2", plan="auto"),
            check_tp("nemotron_h", plan="auto"), check_tp("jamba", plan="auto"), check_tp("bamba", plan="auto"),
            check_tp("granitemoehybrid", plan="auto"), check_tp("zamba2", plan="auto"),
            # Falcon-H1: in_proj's output scaled per channel (mup_vector); its norm gates after or before
            check_tp("falcon_h1", plan="auto", mamba_rms_norm=True),
            check_tp("falcon_h1", plan="auto", mamba_rms_norm=True, mamba_norm_before_gate=False),
            # Zamba: per-head x_proj and dt_proj tensors [heads, ...], split along their heads
            check_tp("zamba", plan="auto")]


def test_mamba_mixers_split_by_channels(ranks):
    for details in ranks(2).run(_tp_checks, timeout=TIMEOUT_S):
        assert all(d.startswith("loss") for d in details), details
        # Mamba: 9 parameters per layer (dt_proj's weight too) and the tied embedding; its 4 linears all split
        assert "37 sharded" in details[0] and "37 sharded" in details[1], details
        assert details[1].endswith("FalconMambaBlock 4/4"), details
        # Mamba 2: 8 per layer (in_proj, the conv's 2, A_log, D, dt_bias, the norm, out_proj), embedding, head
        assert "34 sharded" in details[2] and details[2].endswith("Mamba2Block 2/2"), details
        # Nemotron-H under plan="auto": its Mamba 2 mixer layer splits too (it stayed whole: 0-4/4 before)
        assert details[3].endswith("NemotronHBlock 2-4/4"), details
        # Jamba under plan="auto": its Mamba 1 mixers split too (0-3/7 before; 4 of 7 where the MLP's experts stay whole)
        assert details[4].endswith("JambaMambaDecoderLayer 5-7/7"), details  # its experts counted (auto_experts)
        # One group of heads over 2 ranks: the mixers split too (they stayed whole: 3/5, 2/4, 0/2 before)
        assert details[5].endswith("BambaDecoderLayer 5/5"), details
        assert details[6].endswith("GraniteMoeHybridDecoderLayer 5/5"), details
        # Zamba's shared transformer (attention, then its MLP on o_proj's output: no residual add between)
        # splits too, group by group (2/11 and 2/10 before: inner writers); Zamba 2's MLP splits with its
        # LoRA adapter: A whole, B by columns beside gate_up_proj (6/11 before: latents)
        assert details[7].endswith("Zamba2MambaDecoderLayer 2/2, Zamba2HybridLayer 9/11"), details
        assert details[8].endswith("FalconH1DecoderLayer 9/9") and details[9].endswith("9/9"), details  # (7/9 before)
        assert details[10].endswith("ZambaMambaDecoderLayer 2/2, ZambaHybridLayer 9/10"), details  # (nothing before)


def _fewer_groups_than_ranks():
    return [check_tp("mamba2", tp=4, n_groups=groups) for groups in (1, 2)] + [
        check_tp("falcon_h1", tp=4, plan="auto", mamba_rms_norm=True, mamba_n_groups=2)]


def test_mamba2_groups_copied_over_four_ranks(ranks):
    for details in ranks(4).run(_fewer_groups_than_ranks, timeout=TIMEOUT_S):
        assert all("34 sharded" in d for d in details[:2]), details
        assert details[2].endswith("FalconH1DecoderLayer 9/9"), details


def _tp_and_pp():
    return [check_pp(model_type, tp=2, schedule="zb-h1", n_microbatches=4) for model_type in ("mamba", "mamba2")] + [
        check_pp(model_type, tp=2, schedule="zb-h1", n_microbatches=4, plan="auto") for model_type in ("jamba", "bamba")]


@pytest.mark.timeout(TIMEOUT_S + 60)
def test_mamba_under_tp_and_pp(ranks):
    for details in ranks(4).run(_tp_and_pp, timeout=TIMEOUT_S):
        assert all("grads on this rank" in d for d in details), details


def test_auto_finds_mamba_mixers_of_hybrid_families():
    from torchpp.models.mamba_plans import mamba_mixers

    plan, whole = mamba_mixers(tiny_model("jamba"), "model.layers", 2)  # Mamba 1, norms on dt, B and C
    assert plan["model.layers.0.mamba.x_proj"] == "rowwise_copy_output" and not whole
    assert {plan[f"model.layers.0.mamba.{norm}_layernorm"] for norm in ("dt", "b", "c")} == {"replicated_with_grad_allreduce"}

    plan, whole = mamba_mixers(tiny_model("nemotron_h"), "model.layers", 2)  # n_groups=2
    assert plan["model.layers.0.mixer.in_proj"] == "packed_colwise(128,128,32@2,32@2,4)" and not whole
    plan, whole = mamba_mixers(tiny_model("bamba"), "model.layers", 2)  # n_groups=1: B and C copied
    assert plan["model.layers.0.mamba.in_proj"] == "packed_colwise(128,128,16@1,16@1,4)" and not whole
    assert plan["model.layers.0.mamba.norm"] == "gated_group_rmsnorm"
    plan, whole = mamba_mixers(tiny_model("zamba"), "model.layers", 2)  # per-head tensors, heads first
    assert plan["model.layers.0.mamba.x_proj_weight"] == "split_leading_dim" and not whole
    plan, whole = mamba_mixers(tiny_model("bamba"), "model.layers", 3)  # 4 heads: stays whole, says why
    assert not plan and "tp=3 does not divide its num_heads=4" in whole["model.layers.0.mamba.out_proj"]


def test_mamba2_needs_whole_groups_of_heads_per_rank():
    with pytest.raises(PlanError, match=r"Mamba2Mixer cannot split: tp=3 neither divides its n_groups=2 nor"):
        mamba2_plan(tiny_model("mamba2", n_groups=2, num_heads=6, head_dim=32, expand=3), 3)


def test_a_fused_mamba_kernel_is_refused(monkeypatch):
    model = tiny_model("mamba")
    module = __import__(type(model.backbone.layers[0].mixer).__module__, fromlist=["mamba_inner_fn"])

    def kernel(xz, conv1d_weight, conv1d_bias, x_proj_weight, delta_proj_weight, out_proj_weight, out_proj_bias, A,
               **kwargs):
        return xz.float()  # a kernel reads its inputs

    monkeypatch.setattr(module, "mamba_inner_fn", kernel)
    with pytest.raises(PlanError, match="MambaMixer trains through mamba-ssm's fused kernel"):
        refuse_fused_kernel(model, None)
    monkeypatch.undo()
    refuse_fused_kernel(model, None)  # transformers' reference path: nothing to refuse


def test_conv_channels_splits_only_a_depthwise_conv():
    with pytest.raises(PlanError, match="splits a depthwise nn.Conv1d"):
        STYLES["conv_channels"].apply(nn.Conv1d(4, 4, 3), "mixer.conv1d", None)
