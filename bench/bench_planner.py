"""The planner at cluster scale: CPU time of ``torchpp.plan.plan`` and its choices against the
layouts the PTD-P paper (Narayanan et al. 2021, arXiv 2104.04473) published.

  1. CPU time (``time.process_time``) of GPT-3 175B on 96 GPUs (global batch 1536) and of
     Megatron's 1T configuration (128 layers, hidden 25600, 160 heads, batch 3072) on 3072 GPUs,
     both at sequence length 2048 on A100-80GB, torchpp's full feature set; with
     ``--exhaustive`` also the exhaustive search for the 96-GPU case and whether its best
     equals the pruned search's.
  2. The paper's weak-scaling table (Table 1: 1.7B to 1T, t and p per size) and its 175B / 96-GPU
     runs, planned with the paper's feature set (``Training.megatron2``): the planner's modelled
     step for the published (t, p) (its best microbatch size and schedule) against its own top
     plan; where they differ by more than 10%, why the planner prefers its own.

    PYTHONPATH=. python bench/bench_planner.py [--sections 12] [--exhaustive]
"""
from __future__ import annotations

import argparse
import time

from torchpp.plan import Cluster, PRESETS, Training, plan
from torchpp.plan.layout import describe
from torchpp.plan.published import PTDP_WEAK_SCALING, best_with
from torchpp.plan.planner import KEEP, _layouts

SEQ = 2048
GPT_1T = PTDP_WEAK_SCALING[-1].model


def timed_plan(model, cluster, training, keep=KEEP):
    start = time.process_time()
    result = plan(model, cluster, training, keep=keep)
    return result, time.process_time() - start


def section_speed(exhaustive: bool) -> None:
    print("1. planner CPU time (time.process_time), torchpp's features (Training defaults)\n")
    print("| case | CPU s | best layout | step (s) | layouts | pruned by bound |\n|---|---|---|---|---|---|")
    cases = [("GPT-3 175B, 96 GPUs, batch 1536", PRESETS["gpt3-175b"], Cluster(96, 80e9), Training(1536, SEQ)),
             ("1T (128 x 25600, 160 heads), 3072 GPUs, batch 3072", GPT_1T, Cluster(3072, 80e9), Training(3072, SEQ))]
    for label, model, cluster, training in cases:
        result, seconds = timed_plan(model, cluster, training)
        total = len(list(_layouts(model, cluster, training)))
        print(f"| {label} | {seconds:.1f} | {describe(result.best.layout)} | {result.best.step_time:.3f} | {total} | "
              f"{result.rejected.get('bound above the leaders', 0)} |")
    if exhaustive:
        model, cluster, training = PRESETS["gpt3-175b"], Cluster(96, 80e9), Training(1536, SEQ)
        full, seconds = timed_plan(model, cluster, training, keep=None)
        pruned, _ = timed_plan(model, cluster, training)
        same = [a.layout == b.layout and a.step_time == b.step_time for a, b in zip(full.ranked[:10], pruned.ranked[:10])]
        print(f"\nexhaustive 175B / 96: {seconds:.1f} s CPU, best {describe(full.best.layout)} "
              f"{full.best.step_time:.4f} s; the pruned top 10 equal it: {all(same)}")


def why(ours, theirs) -> str:
    deltas = {k: theirs.breakdown[k] - ours.breakdown[k] for k in ours.breakdown}
    worst = max(deltas, key=deltas.get)
    return (f"published layout loses mostly on {worst} (+{deltas[worst]:.3f} s); "
            + ", ".join(f"{k} {v:+.3f}" for k, v in deltas.items() if abs(v) > 1e-3))


def section_ptdp() -> None:
    print("\n2. the PTD-P paper's layouts (Table 1, and 175B on 96 GPUs), planned with its feature set "
          "(Training.megatron2: no SP, no ZeRO, full recompute, 1F1B / interleaved, blocking P2P), A100-80GB\n")
    print("| model | GPUs | batch | published t/p/d | its modelled step (s) | planner's top | top step (s) | "
          "published / top | note |\n|---|---|---|---|---|---|---|---|---|")
    rows = [(f"{row.billions:g}B", row.model, row.gpus, row.global_batch, row.tp, row.pp) for row in PTDP_WEAK_SCALING]
    rows += [("GPT-3 175B", PRESETS["gpt3-175b"], 96, batch, 8, 12) for batch in (24, 60)]
    for label, model, gpus, batch, t, p in rows:
        cluster, training = Cluster(gpus, 80e9), Training.megatron2(batch, SEQ)
        start = time.process_time()
        top = plan(model, cluster, training).best
        theirs = best_with(model, cluster, training, t, p)
        cpu = time.process_time() - start
        if theirs is None:
            print(f"| {label} | {gpus} | {batch} | {t}/{p}/{gpus // (t * p)} | does not fit | "
                  f"{describe(top.layout)} | {top.step_time:.3f} | - | ({cpu:.1f} s CPU) |")
            continue
        ratio = theirs.step_time / top.step_time
        note = "within 10%" if ratio <= 1.10 else why(top, theirs)
        print(f"| {label} | {gpus} | {batch} | {t}/{p}/{gpus // (t * p)} ({describe(theirs.layout)}) | "
              f"{theirs.step_time:.3f} | {describe(top.layout)} | {top.step_time:.3f} | {ratio:.3f} | {note} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", default="12")
    parser.add_argument("--exhaustive", action="store_true", help="also time the exhaustive 96-GPU search (minutes)")
    args = parser.parse_args()
    print(f"started {time.ctime()}\n")
    if "1" in args.sections:
        section_speed(args.exhaustive)
    if "2" in args.sections:
        section_ptdp()


if __name__ == "__main__":
    main()
