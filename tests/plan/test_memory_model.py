"""Memory model: SPEC.md section 4 formulas, and a check against a real CPU run of a tiny model."""
import math

import pytest
import torch
from torch import nn

from torchpp import schedule as S
from torchpp.plan import SavedActivationMeter, layer_activation_bytes, model_state_bytes, peak_inflight


def test_formulas_match_spec_at_16_bit():
    s, b, h, a, t = 2048, 2, 1024, 16, 4
    sbh = s * b * h
    assert layer_activation_bytes(s, b, h, a) == sbh * (34 + 5 * a * s / h)
    assert layer_activation_bytes(s, b, h, a, tp=t) == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)))
    assert layer_activation_bytes(s, b, h, a, tp=t, sequence_parallel=True) == pytest.approx(sbh / t * (34 + 5 * a * s / h))
    assert layer_activation_bytes(s, b, h, a, tp=t, sequence_parallel=True, recompute="selective") == pytest.approx(34 * sbh / t)
    assert layer_activation_bytes(s, b, h, a, tp=t, recompute="full") == 2 * sbh
    assert model_state_bytes(1e9) == 16e9
    # Context parallelism: s/c tokens per rank, queries of s/c against all s keys: everything / c.
    for c in (2, 4):
        assert layer_activation_bytes(s, b, h, a, tp=t, cp=c) == pytest.approx(layer_activation_bytes(s, b, h, a, tp=t) / c)
    with pytest.raises(ValueError, match="cp=3 must be at least 1 and divide the sequence length 2048"):
        layer_activation_bytes(s, b, h, a, cp=3)
    assert model_state_bytes(1e9, dp=4, zero1=True) == 1e9 * (2 + 2 + 12 / 4)


class Block(nn.Module):
    """Megatron-style pre-LN GPT block written op by op, as the formula counts them."""

    def __init__(self, h, heads, p=0.1):
        super().__init__()
        self.heads, self.p = heads, p
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x):  # x: (s, b, h)
        s, b, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(s, b * self.heads, 3, h // self.heads).permute(2, 1, 0, 3)
        scores = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(h // self.heads), dim=-1)
        context = (nn.functional.dropout(scores, self.p) @ v).transpose(0, 1).reshape(s, b, h)
        x = x + nn.functional.dropout(self.proj(context), self.p)
        return x + nn.functional.dropout(self.fc2(nn.functional.gelu(self.fc1(self.ln2(x)))), self.p)


def test_model_matches_a_real_1f1b_run_within_15_percent():
    torch.manual_seed(0)
    s, b, h, a, layers, p, m = 64, 2, 64, 4, 3, 4, 8
    stage = nn.Sequential(*[Block(h, a) for _ in range(layers)])
    optimizer = torch.optim.Adam(stage.parameters())
    inputs = [torch.randn(s, b, h, requires_grad=True) for _ in range(m)]

    # Rank 0 of a p-rank 1F1B pipeline, run in its real action order; the meter sees what lives.
    outputs = {}
    with SavedActivationMeter() as meter:
        for action in S.generate("1f1b", num_ranks=p, num_microbatches=m).actions(0):
            mb = int(action.split("F")[-1] if "F" in action else action.split("B")[-1])
            if "F" in action:
                outputs[mb] = stage(inputs[mb])
            else:
                outputs.pop(mb).sum().backward()
    optimizer.step()
    measured_state = sum(t.numel() * t.element_size() for p_ in stage.parameters()
                         for t in (p_, p_.grad, *optimizer.state[p_].values()) if t.dim() > 0)
    measured = measured_state + meter.peak_bytes

    num_params = sum(p_.numel() for p_ in stage.parameters())
    # fp32 everywhere: 4-byte weights and grads, Adam's two 4-byte moments (no master copy).
    predicted_state = model_state_bytes(num_params, weight_bytes=4, grad_bytes=4, optimizer_bytes=8)
    # CPU dropout keeps a float mask, so masks cost E bytes here (a bool byte in fused GPU kernels).
    per_layer = layer_activation_bytes(s, b, h, a, element_bytes=4, mask_bytes=4)
    predicted = predicted_state + peak_inflight("1f1b", p, m)[0] * layers * per_layer
    assert meter.peak_bytes > 0 and meter.live_bytes == 0  # everything saved was released
    assert abs(predicted - measured) / measured < 0.15, (predicted, measured, meter.peak_bytes)
    assert abs(peak_inflight("1f1b", p, m)[0] * layers * per_layer - meter.peak_bytes) / meter.peak_bytes < 0.15
