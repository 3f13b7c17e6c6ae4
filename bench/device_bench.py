"""Shared pieces of the device benchmarks (bench_split_bw.py, bench_stage_mfu.py,
bench_cp_block.py, bench_bubble_nccl.py): the device (CUDA when present, else the CPU at small
sizes), device-synchronised interleaved timing (median and spread), peak memory of a call, a
one-rank process group, and each script's results as JSON next to its printout."""
from __future__ import annotations

import argparse
import atexit
import json
import os
import sys
import tempfile
import time
from typing import Callable, Dict, List

import torch
import torch.distributed as dist

from timing import median_spread  # bench/timing.py, next to this script

__all__ = ["add_arguments", "device_of", "synchronize", "time_variants", "peak_bytes", "cpu_allocations_returned",
           "single_rank_group", "write_json", "median_spread", "fmt_ms"]


def add_arguments(parser: argparse.ArgumentParser, repeats: int = 10) -> None:
    parser.add_argument("--cpu", action="store_true", help="run on the CPU even where CUDA is present")
    parser.add_argument("--small", action="store_true", help="small sizes (the default on the CPU)")
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")


def device_of(args) -> torch.device:
    """CUDA unless absent or --cpu; the CPU implies --small."""
    if torch.cuda.is_available() and not args.cpu:
        return torch.device("cuda", torch.cuda.current_device())
    args.small = True
    return torch.device("cpu")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_variants(variants: Dict[str, Callable[[], None]], device: torch.device, repeats: int,
                  warmup: int = 2) -> Dict[str, List[float]]:
    """Seconds of each variant, device work included; every variant once per round, in turn,
    so drift and noise hit all alike."""
    for _ in range(warmup):
        for fn in variants.values():
            fn()
    samples: Dict[str, List[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            synchronize(device)
            start = time.perf_counter()
            fn()
            synchronize(device)
            samples[name].append(time.perf_counter() - start)
    return samples


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def peak_bytes(fn: Callable[[], None], device: torch.device) -> int:
    """Memory a call needs beyond what is allocated before it: the CUDA caching allocator's peak,
    or on the CPU the peak resident set (reset through /proc/self/clear_refs) over the resident
    set before; run the CPU benchmarks under MALLOC_MMAP_THRESHOLD_ so freed blocks leave it."""
    synchronize(device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # resets VmHWM, the peak resident set
    before = _status_kib("VmRSS")
    fn()
    return max(0, _status_kib("VmHWM") - before) * 1024


def cpu_allocations_returned() -> None:
    """Re-executes this script with glibc's mmap threshold fixed at 64 KiB (once): freed large
    blocks then leave the resident set, so its peak measures what a call holds at once."""
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        os.execve(sys.executable, [sys.executable] + sys.argv,
                  {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"})


def single_rank_group(device: torch.device) -> None:
    """A process group of this process alone (torchpp's ops and parallelize take a group)."""
    if dist.is_initialized():
        return
    store = os.path.join(tempfile.mkdtemp(prefix="torchpp_bench_"), "store")
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)
    atexit.register(dist.destroy_process_group)  # NCCL warns at exit about a group left alive


def fmt_ms(times: List[float]) -> str:
    median, spread = median_spread(times)
    return f"{median * 1e3:.2f} ms (spread {spread:.0%})"


def write_json(args, record: dict) -> None:
    record = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() and not args.cpu else "cpu",
              "torch": torch.__version__, "cuda": torch.version.cuda, **record}
    if args.json:
        with open(args.json, "w") as out:
            json.dump(record, out, indent=1)
