"""Mamba's mixer under tensor parallelism (torchpp's family plan, ``torchpp.models.plans.MAMBA_PLAN``):
channels split as Megatron splits them, x_proj's row split summed forward and, since the per-channel
scan reads dt, B and C back, its output gradient summed too (``rowwise_copy_output``); the depthwise
conv on this rank's channels (``conv_channels``). Mamba and Falcon-Mamba at tp=2, Mamba at tp=2 x pp=2
under zb-h1 (x_proj's weight gradient deferred to W), in float64 against the unwrapped model: loss,
logits, every gradient, one SGD step (torchpp.testing.model_checks)."""
import pytest
import torch
from torch import nn

from torchpp.models.plans import _mamba_fixups
from torchpp.tensor_parallel.styles import STYLES, PlanError
from torchpp.testing.model_checks import check_pp, check_tp
from torchpp.testing.tiny_models import tiny_model

TIMEOUT_S = 240


def _tp_checks():
    return [check_tp("mamba"), check_tp("falcon_mamba", plan="auto")]


def test_mamba_mixers_split_by_channels(ranks):
    for details in ranks(2).run(_tp_checks, timeout=TIMEOUT_S):
        # every linear of the mixer splits (dt_proj's weight too); 9 parameters per layer and the tied embedding
        assert all(d.startswith("loss") and "37 sharded" in d for d in details), details
        assert details[1].endswith("MambaBlock 4/4") or details[1].endswith("FalconMambaBlock 4/4"), details


def _tp_and_pp():
    return check_pp("mamba", tp=2, schedule="zb-h1", n_microbatches=4)


@pytest.mark.timeout(TIMEOUT_S + 60)
def test_mamba_under_tp_and_pp(ranks):
    assert all("grads on this rank" in d for d in ranks(4).run(_tp_and_pp, timeout=TIMEOUT_S))


def test_a_fused_mamba_kernel_is_refused(monkeypatch):
    model = tiny_model("mamba")
    module = __import__(type(model.backbone.layers[0].mixer).__module__, fromlist=["mamba_inner_fn"])

    def kernel(xz, conv1d_weight, conv1d_bias, x_proj_weight, delta_proj_weight, out_proj_weight, out_proj_bias, A,
               **kwargs):
        return xz.float()  # a kernel reads its inputs

    monkeypatch.setattr(module, "mamba_inner_fn", kernel)
    with pytest.raises(PlanError, match="MambaMixer trains through mamba-ssm's fused kernel"):
        _mamba_fixups(model, None)
    monkeypatch.undo()
    _mamba_fixups(model, None)  # transformers' reference path: nothing to refuse


def test_conv_channels_splits_only_a_depthwise_conv():
    with pytest.raises(PlanError, match="splits a depthwise nn.Conv1d"):
        STYLES["conv_channels"].apply(nn.Conv1d(4, 4, 3), "mixer.conv1d", None)
