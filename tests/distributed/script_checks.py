"""Rank-side check of TorchScript stages: the executor runs them from C++ without entering
Python, with losses and gradients equal to the same blocks run in one process."""
from __future__ import annotations

import copy
import sys
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from torchpp import schedule as S
from torchpp.pipeline import PipelineStage, SplitBWLinear, build_schedule

PYTHON_STAGE_CODE = {"forward", "_forward"}  # module forwards and the executor's Python callback


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = SplitBWLinear(width, 2 * width)
        self.fc2 = SplitBWLinear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


def train_scripted(name, script=True, loss_scale=None, m=4, batch=8, width=8, steps=2):
    group = dist.new_group(list(range(dist.get_world_size())))
    try:
        return _train(name, script, loss_scale, m, batch, width, steps, group)
    except Exception:
        return {"error": traceback.format_exc()}


def _train(name, script, loss_scale, m, batch, width, steps, group):
    rank, p = dist.get_rank(group), dist.get_world_size(group)
    per_rank = 2 if name == "interleaved-1f1b" else 1
    probe = S.generate(name, num_ranks=p, num_microbatches=m, num_chunks=per_rank)
    n = probe.num_stages
    torch.manual_seed(0)
    blocks = [Block(width).double() for _ in range(n)]
    reference = nn.Sequential(*copy.deepcopy(blocks))
    mine = sorted(s for s, r in enumerate(probe.stage_to_rank) if r == rank)
    wrap = torch.jit.script if script else (lambda module: module)
    stages = [PipelineStage(wrap(blocks[s]), s, n, "cpu", group=group) for s in mine]
    loss_fn = wrap(nn.MSELoss())
    # A loss scale multiplies the seeds C++ gives the scripted losses' backward (fp16's loss scaling).
    scaler = torch.amp.GradScaler("cpu", init_scale=loss_scale) if loss_scale else None
    sched = build_schedule(name, stages, m, loss_fn=loss_fn, grad_scaler=scaler)
    params = {s: list(blocks[s].parameters()) for s in mine}
    opt = torch.optim.SGD([q for s in mine for q in params[s]], lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    python_calls = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_name in PYTHON_STAGE_CODE:
            python_calls.append(frame.f_code.co_qualname)

    results = []
    for step in range(steps):
        gen = torch.Generator().manual_seed(100 + step)
        x = torch.randn(batch, width, generator=gen, dtype=torch.float64)
        y = torch.randn(batch, width, generator=gen, dtype=torch.float64)
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
        losses = []
        sys.setprofile(profile)
        try:
            sched.step(*([x] if 0 in mine else []), target=y if n - 1 in mine else None, losses=losses)
        finally:
            sys.setprofile(None)
        ref_loss = F.mse_loss(reference(x), y)
        ref_loss.backward()
        for s in mine:
            for (pname, ref), got in zip(reference[s].named_parameters(), params[s]):
                got.grad.div_(loss_scale or 1)  # unscaled, as GradScaler.unscale_ would (a power of two: exact)
                torch.testing.assert_close(got.grad, ref.grad, rtol=1e-10, atol=1e-12,
                                           msg=lambda msg, s=s, pname=pname: f"step {step} stage {s} {pname}: {msg}")
        mean_loss = sum(loss.item() for loss in losses) / m if losses else None
        results.append({"loss": mean_loss, "ref_loss": ref_loss.item()})
        opt.step()
        ref_opt.step()
    # eval() with and without target: forward only, through the same TorchScript path.
    gen = torch.Generator().manual_seed(200)
    x = torch.randn(batch, width, generator=gen, dtype=torch.float64)
    y = torch.randn(batch, width, generator=gen, dtype=torch.float64)
    with torch.no_grad():
        ref_out = reference(x)
    evals = []
    for target in (y, None):
        losses = []
        sys.setprofile(profile)
        try:
            out = sched.eval(*([x] if 0 in mine else []), target=target if n - 1 in mine else None, losses=losses)
        finally:
            sys.setprofile(None)
        if n - 1 in mine:
            torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-12)
            assert len(losses) == (m if target is not None else 0), losses
        evals.append(sum(loss.item() for loss in losses) / m if losses else None)
    return {"torchscript_stages": sched.torchscript_stages, "python_calls": sorted(set(python_calls)),
            "steps": results, "eval_loss": evals[0], "eval_ref_loss": F.mse_loss(ref_out, y).item()}
