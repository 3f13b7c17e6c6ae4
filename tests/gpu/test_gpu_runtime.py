"""The pipeline executor on CUDA over NCCL (p=2, 1F1B, plain float32 stages):

- no host synchronisation per action: the CUDA runtime's synchronising calls in one step are as
  many at 8 microbatches as at 2 (what is left is per step: the step-start vote read on the host
  and the timeline's event reads);
- the real-run timeline's compute spans are timed by CUDA events: a forward whose kernels take
  milliseconds on the device spans them, though its launches return in a fraction of that;
- the gradients equal one process's over several steps (transfers complete before their
  buffers are reused or read), in float64: 40 chained float32 matmuls summed per microbatch
  rather than over the whole batch differ by ~1e-6 of the gradient's scale on the GPU.
"""
import math
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from torchpp.pipeline import PipelineStage, build_schedule
from torchpp.pipeline.trace import COMPUTE, parse_action

# width, rows, matmuls: tiny in the CPU dry run. On the GPU each matmul's kernel must outlast its launch
# many times over: at 512 rows, with three test files' ranks sharing the H100's host, a forward's 40
# launches took 2.4 ms of its 9.0 ms on the device (below the 4x the timing check needs).
SIZES = {"cuda": (2048, 2048, 40), "cpu": (128, 16, 4)}
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


class Heavy(nn.Module):
    """`repeats` matmuls: milliseconds of device work per microbatch, little host work."""

    def __init__(self, seed: int, width: int, repeats: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.weight = nn.Parameter(torch.randn(width, width, generator=g) / math.sqrt(width))
        self.repeats = repeats

    def forward(self, x):
        for _ in range(self.repeats):
            x = torch.tanh(x @ self.weight)
        return x


def _loss(out, target):
    return (out - target).pow(2).mean()


def _pipeline(m: int, device, dtype=torch.float32):
    rank = dist.get_rank()
    width, rows, repeats = SIZES[device.type]
    stage = PipelineStage(Heavy(rank, width, repeats).to(device, dtype), rank, 2, device)
    sched = build_schedule("1f1b", stage, m, loss_fn=_loss)
    x = torch.randn(rows * m, width, generator=torch.Generator().manual_seed(3)).to(device, dtype)
    return stage, sched, x


def _run(sched, stage, x):
    return sched.step(x if stage.is_first else None, target=x if stage.is_last else None)


def _sync_calls(m: int, device) -> int:
    stage, sched, x = _pipeline(m, device)
    _run(sched, stage, x)  # the first step also exchanges shapes
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        _run(sched, stage, x)
    return sum(event.name in SYNC_CALLS for event in prof.events())


def check_no_sync_per_action(device):
    if device.type == "cpu":
        return "cpu: no device to synchronise with"
    few, many = _sync_calls(2, device), _sync_calls(8, device)
    assert few == many, f"synchronising CUDA calls per step: {few} at m=2, {many} at m=8 (one per action?)"
    return few


def test_no_host_sync_per_action(gpu_ranks, device):
    counts = gpu_ranks(2).run(check_no_sync_per_action, device, timeout=240)
    print(f"synchronising CUDA runtime calls per step, per rank: {counts}")


def check_device_timed_spans(device):
    stage, sched, x = _pipeline(4, device)
    _run(sched, stage, x)
    # One microbatch's forward alone: how long its launches take on the host, and on the device.
    probe = x[:x.size(0) // 4].clone()
    with torch.no_grad():
        synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        synchronize()
        start = time.perf_counter()
        stage.submod(probe)
        launch_us = (time.perf_counter() - start) * 1e6
        synchronize()
        device_us = (time.perf_counter() - start) * 1e6
    _run(sched, stage, x)
    spans = [(a, s, e) for a, s, e, _ in sched.timeline() if parse_action(a)[1] in COMPUTE]
    forwards = [e - s for a, s, e in spans if parse_action(a)[1] == "F"]
    assert len(forwards) == 4, spans
    ordered = sorted(spans, key=lambda span: span[1])
    for (a, _, end), (b, start, _) in zip(ordered, ordered[1:]):
        assert start >= end - 1.0, f"compute spans {a} and {b} overlap on one rank: {end} > {start}"
    if device.type == "cuda":
        # Host-timed spans would last about as long as the launches; device-timed ones as the kernels.
        # The median, since the ranks (and other tests' ranks) share the GPU: a span that ran alone is
        # shorter than the probe, which ran beside the other rank's (seen: 4.5 ms of 9.3).
        assert device_us > 4 * launch_us, f"the probe does not tell them apart: {launch_us:.0f} vs {device_us:.0f} us"
        median = sorted(forwards)[len(forwards) // 2]
        assert median > 2 * launch_us, (f"forward spans {forwards} us are as short as their launches "
                                        f"({launch_us:.0f} us; {device_us:.0f} us on the device): host-timed?")
    return min(forwards), launch_us, device_us


def test_timeline_spans_are_device_timed(gpu_ranks, device):
    per_rank = gpu_ranks(2).run(check_device_timed_spans, device, timeout=240)
    print(f"shortest forward span, one forward's launches, its device time (us), per rank: {per_rank}")


def check_steps_equal_one_process(device):
    rank = dist.get_rank()
    stage, sched, x = _pipeline(4, device, torch.float64)
    width, _, repeats = SIZES[device.type]
    reference = nn.Sequential(Heavy(0, width, repeats), Heavy(1, width, repeats)).to(device, torch.float64)
    for step in range(3):
        stage.submod.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
        batch = x * (step + 1) / 3
        _run(sched, stage, batch)
        _loss(reference(batch), batch).backward()
        want = reference[rank].weight.grad
        torch.testing.assert_close(stage.submod.weight.grad, want, rtol=1e-9, atol=1e-12 * want.abs().max().item())
    return True


def test_steps_equal_one_process(gpu_ranks, device):
    assert gpu_ranks(2).run(check_steps_equal_one_process, device, timeout=240) == [True, True]
