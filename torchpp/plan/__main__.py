"""python -m torchpp.plan: pick the PTD-P layout and schedule for a model on a cluster."""
from __future__ import annotations

import argparse
import re
import sys

from torchpp.plan.model_config import load_model_config
from torchpp.plan.planner import KEEP, Cluster, PlanError, Training, plan
from torchpp.plan.report import format_plan

_UNITS = {"": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}


def parse_bytes(text: str) -> float:
    """'80GB', '25GB/s', '1.5e9' -> bytes (decimal units)."""
    match = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([KMGT]?)(?:i?B)?(?:/s)?\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (try 80GB or 25GB/s)")
    return float(match.group(1)) * _UNITS[match.group(2)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torchpp.plan", description=__doc__)
    parser.add_argument("--model", required=True, help="preset name or transformers config.json")
    parser.add_argument("--gpus", type=int, required=True)
    parser.add_argument("--gpu-memory", type=parse_bytes, default=parse_bytes("80GB"))
    parser.add_argument("--global-batch", type=int, required=True)
    parser.add_argument("--seq-len", type=int, required=True)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--intra-node-bandwidth", type=parse_bytes, default=parse_bytes("250GB/s"))
    parser.add_argument("--inter-node-bandwidth", type=parse_bytes, default=parse_bytes("25GB/s"))
    parser.add_argument("--peak-tflops", type=float, default=312.0)
    parser.add_argument("--efficiency", type=float, default=0.5, help="achieved fraction of peak FLOP/s")
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--exhaustive", action="store_true",
                        help="evaluate every layout exactly instead of letting bounds prune (slow at scale)")
    parser.add_argument("--plot", help="draw the best layout's schedule timeline to this PNG")
    args = parser.parse_args(argv)

    cluster = Cluster(args.gpus, args.gpu_memory, args.gpus_per_node, args.intra_node_bandwidth,
                      args.inter_node_bandwidth, args.peak_tflops * 1e12, args.efficiency)
    try:
        result = plan(load_model_config(args.model), cluster, Training(args.global_batch, args.seq_len),
                      keep=None if args.exhaustive else max(KEEP, args.top))
    except (PlanError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(format_plan(result, args.top))
    if args.plot:
        _plot(result, args.plot)
    return 0


def _plot(result, path: str) -> None:
    from torchpp import schedule as S

    lay = result.best.layout
    if lay.pp == 1:
        print(f"no pipeline (pp=1): nothing to plot to {path}")
        return
    sch = S.generate(lay.schedule, num_ranks=lay.pp, num_microbatches=min(lay.num_microbatches, 4 * lay.pp),
                     num_chunks=lay.chunks)
    S.simulate(sch).plot(path)
    print(f"wrote {path} ({lay.schedule}, first {min(lay.num_microbatches, 4 * lay.pp)} microbatches)")


if __name__ == "__main__":
    sys.exit(main())
