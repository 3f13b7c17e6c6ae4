"""``python -m torchpp.schedule``: generate a schedule, print its grid, bubble and memory."""
from __future__ import annotations

import argparse
import sys

from torchpp.schedule.schedule import SCHEDULES, generate
from torchpp.schedule.simulation import simulate


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m torchpp.schedule", description=__doc__)
    parser.add_argument("--schedule", required=True, choices=SCHEDULES)
    parser.add_argument("--pp", type=int, required=True, help="pipeline ranks p")
    parser.add_argument("--microbatches", type=int, required=True, help="microbatches m")
    parser.add_argument("--chunks", type=int, default=None, help="stages per rank v")
    parser.add_argument("--costs", default="1,1,1", help="F,I,W[,comm] (default 1,1,1)")
    parser.add_argument("--memory-limit", type=float, default=None,
                        help="zb-auto and the V family (zb-v, v-half, v-min): memory per rank, M_B per "
                             "activation plus M_W per pending W")
    parser.add_argument("--memory-units", default="1,0.5", help="M_B,M_W (default 1,0.5)")
    parser.add_argument("--group-size", type=int, default=None, help="interleaved-1f1b microbatch group size")
    parser.add_argument("--max-steps", type=int, default=0, help="cut the printed grid after this many steps")
    parser.add_argument("--lowered", action="store_true", help="print and export the lowered schedule")
    parser.add_argument("--csv", help="write the schedule as CSV (torch.distributed.pipelining format)")
    parser.add_argument("--trace", help="write a Chrome trace JSON")
    parser.add_argument("--plot", help="write a timeline image")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        costs = tuple(float(c) for c in args.costs.split(","))
        units = dict(zip(("activation", "weight_pending"), (float(u) for u in args.memory_units.split(","))))
        sch = generate(args.schedule, args.pp, args.microbatches, num_chunks=args.chunks,
                       costs=dict(zip(("f", "i", "w", "comm"), costs), **units),
                       memory_limit=args.memory_limit, microbatch_group_size=args.group_size)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    shown = sch.lowered() if args.lowered else sch
    sim = simulate(sch, *costs, **units)
    print(shown.grid(args.max_steps), end="")
    print(f"schedule {sch.name}: p={sch.num_ranks} m={sch.num_microbatches} stages={sch.num_stages} "
          f"costs F,I,W,comm={','.join(f'{c:g}' for c in (costs + (0.0,))[:4])}")
    print(f"makespan {sim.makespan:g}  bubble {sim.bubble:g}  bubble ratio {sim.bubble_ratio:.4f}")
    print("peak activations per rank (M_B):", " ".join(str(a) for a in sim.peak_activations))
    print("peak pending W per rank (M_W):  ", " ".join(str(a) for a in sim.peak_weight_pending))
    print("peak memory per rank:           ", " ".join(f"{a:g}" for a in sim.peak_memory))
    if args.csv:
        shown.to_csv(args.csv)
    if args.trace:
        sim.to_chrome_trace(args.trace)
    if args.plot:
        sim.plot(args.plot)
    return 0
