"""Pipeline runtime figures (p=2, CPU gloo), every comparison within one run.

  1. Step time of torchpp vs torch.distributed.pipelining: same model, same schedule
     (1F1B, interleaved 1F1B, and the zero-bubble ZB-V), ratio torchpp / torch.
  2. Engine overhead per action: tiny stages, m=64 (step time / compute actions per rank), and
     net of a straight-line floor doing the same work and messages (what the engine adds).
  3. Split B/W linear: I + W time over a standard linear backward at a large size.
  4. Real measured bubble of zb-h1 and 1f1b against the simulator's prediction from the
     measured F/I/W costs.

    PYTHONPATH=. python bench/bench_pipeline.py [--repeats 15]
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

P = 2
HIDDEN, BATCH, M = 256, 128, 8
TINY, TINY_M = 4, 64
# (label, torchpp schedule, torch class name, stages per rank, placement)
PAIRS = [
    ("1F1B", "1f1b", "Schedule1F1B", 1, "single"),
    ("interleaved 1F1B (v=2)", "interleaved-1f1b", "ScheduleInterleaved1F1B", 2, "loop"),
    ("zero bubble ZB-V", "zb-v", "ScheduleZBVZeroBubble", 2, "v"),
]


def stage_ids(rank: int, per_rank: int, placement: str):
    if placement == "single":
        return [rank]
    if placement == "loop":
        return [rank, rank + P]
    return [rank, 2 * P - 1 - rank]


def stage_module(width: int, split: bool, seed: int) -> nn.Module:
    from torchpp.pipeline import SplitBWLinear

    torch.manual_seed(seed)
    linear = SplitBWLinear if split else nn.Linear
    return nn.Sequential(linear(width, width), nn.GELU(), linear(width, width))


def timed_steps(step, repeats: int, warmup: int = 3):
    times = []
    for k in range(warmup + repeats):
        dist.barrier()
        start = time.perf_counter()
        step()
        dist.barrier()
        if k >= warmup:
            times.append(time.perf_counter() - start)
    return times


def summary(times):
    ordered = sorted(times)
    return statistics.median(ordered), ordered[len(ordered) // 10], ordered[-1 - len(ordered) // 10]


def torchpp_step_fn(name, width, m, ids, num_stages, group):
    from torchpp.pipeline import PipelineStage, build_schedule

    stages = [PipelineStage(stage_module(width, True, s), s, num_stages, "cpu", group=group) for s in ids]
    sched = build_schedule(name, stages, m, loss_fn=F.mse_loss)
    x, y = torch.randn(BATCH if width == HIDDEN else m, width), torch.randn(BATCH if width == HIDDEN else m, width)
    return (lambda: sched.step(x, target=y)), sched


def torch_step_fn(cls_name, width, m, ids, num_stages, group):
    from torch.distributed import pipelining as tpp

    stages = [tpp.PipelineStage(stage_module(width, False, s), s, num_stages, torch.device("cpu"), group=group)
              for s in ids]
    cls = getattr(tpp, cls_name)
    sched = cls(stages if len(stages) > 1 else stages[0], m, loss_fn=F.mse_loss)
    batch = BATCH if width == HIDDEN else m
    x, y = torch.randn(batch, width), torch.randn(batch, width)
    holds_first = 0 in ids
    holds_last = num_stages - 1 in ids

    def step():
        if holds_first:
            sched.step(x, target=y if holds_last else None)
        elif holds_last:
            sched.step(target=y)
        else:
            sched.step()
    return step


def straight_line_step_fn(name, per_rank, m, ids, num_stages, group):
    """The floor an engine is measured against: this rank's lowered torchpp action list run as
    a plain Python loop with nothing but the work itself (the same stage forwards/backwards,
    the same isend/irecv in the same order, each receive waited right before its consumer).
    Engine overhead = engine step time - this, so the gloo latency both engines pay cancels."""
    from torchpp import schedule as S
    from torchpp.pipeline.trace import parse_action

    sch = S.generate(name, num_ranks=P, num_microbatches=m, num_chunks=per_rank)
    actions = [parse_action(a) for a in sch.lowered().actions(dist.get_rank(group))]
    modules = {s: stage_module(TINY, False, s) for s in ids}
    x, y = torch.randn(m, TINY).chunk(m), torch.randn(m, TINY).chunk(m)
    peer = lambda stage: dist.get_global_rank(group, sch.stage_to_rank[stage])  # noqa: E731
    me = dist.get_rank(group)
    local = lambda stage: 0 <= stage < num_stages and sch.stage_to_rank[stage] == me  # noqa: E731

    def step():
        inputs, outputs, received, sends = {}, {}, {}, []
        for stage, kind, mb in actions:
            if kind in ("RECV_F", "RECV_B"):
                buf = torch.empty(1, TINY)
                src = stage - 1 if kind == "RECV_F" else stage + 1
                received[(kind, stage, mb)] = (dist.irecv(buf, peer(src), group=group), buf)
            elif kind == "F":
                if stage == 0:
                    inp = x[mb]
                elif local(stage - 1):  # the turn of a V stays on this rank: no message
                    inp = outputs[(stage - 1, mb)].detach().requires_grad_()
                else:
                    work, buf = received.pop(("RECV_F", stage, mb))
                    work.wait()
                    inp = buf.requires_grad_()
                inputs[(stage, mb)], outputs[(stage, mb)] = inp, modules[stage](inp)
            elif kind in ("B", "I"):
                out = outputs.pop((stage, mb))
                if stage == num_stages - 1:
                    F.mse_loss(out, y[mb]).backward()
                elif local(stage + 1):
                    out.backward(inputs.pop((stage + 1, mb)).grad)
                else:
                    work, buf = received.pop(("RECV_B", stage, mb))
                    work.wait()
                    out.backward(buf)
            elif kind == "SEND_F":
                sends.append(dist.isend(outputs[(stage, mb)].detach(), peer(stage + 1), group=group))
            elif kind == "SEND_B":
                sends.append(dist.isend(inputs.pop((stage, mb)).grad, peer(stage - 1), group=group))
            # W: the floor runs whole backwards in I/B, so W has nothing left to do.
        for work in sends:
            work.wait()
    return step


def bench_pairs(rank, repeats, width, m, group):
    rows = []
    for label, name, cls_name, per_rank, placement in PAIRS:
        ids = stage_ids(rank, per_rank, placement)
        num_stages = P * per_rank
        ours, _ = torchpp_step_fn(name, width, m, ids, num_stages, group)
        theirs = torch_step_fn(cls_name, width, m, ids, num_stages, group)
        floor = straight_line_step_fn(name, per_rank, m, ids, num_stages, group) if width == TINY else None
        # Alternate the engines (and the floor) so machine noise hits all alike.
        t_ours, t_theirs, t_floor = [], [], []
        for _ in range(3):
            t_ours += timed_steps(ours, repeats // 3 + 1)
            t_theirs += timed_steps(theirs, repeats // 3 + 1)
            if floor is not None:
                t_floor += timed_steps(floor, repeats // 3 + 1)
        actions = 2 * m * per_rank if name != "zb-v" else 3 * m * per_rank  # F+B, or F+I+W
        rows.append((label, summary(t_ours), summary(t_theirs), actions, summary(t_floor) if t_floor else None))
    return rows


def bench_bubble(rank, repeats, group):
    from torchpp import schedule as S
    from torchpp.pipeline.trace import gather_runs, measured_simulation, measured_transfers

    out = {}
    costs = None
    for name in ("zb-h1", "1f1b"):
        step, sched = torchpp_step_fn(name, HIDDEN, M, [rank], P, group)
        ratios, per_type, latencies = [], {"F": [], "I": [], "W": [], "B": []}, []
        for _ in range(repeats):
            dist.barrier()
            step()
            runs = gather_runs(sched, group)
            sim = measured_simulation(sched, runs)
            ratios.append(sim.bubble_ratio)
            latencies += [(arrive - send) / 1e3 for *_, send, arrive in measured_transfers(runs, 0.0)]
            for line in sim.timeline:
                for _a, kind, _s, _m, start, end in line:
                    per_type[kind].append(end - start)
        if name == "zb-h1":
            costs = {k: statistics.median(v) for k, v in per_type.items() if v}
            # Send to consumer-side arrival; an upper bound on latency when the consumer was late.
            costs["comm"] = statistics.median(latencies)
        predicted = [S.simulate(sched.schedule, f=costs["F"], i=costs["I"], w=costs["W"], comm=comm).bubble_ratio
                     for comm in (0.0, costs["comm"])]
        out[name] = (summary(ratios), predicted)
    return out, costs


def bench_split_linear(repeats):
    from torchpp.pipeline import split_bw_linear, weight_grad_store

    torch.manual_seed(0)
    x = torch.randn(2048, 1024, requires_grad=True)
    w = torch.randn(1024, 1024, requires_grad=True)
    b = torch.randn(1024, requires_grad=True)
    g = torch.randn(2048, 1024)

    def standard():
        F.linear(x, w, b).backward(g)

    def split():
        y = split_bw_linear(x, w, b)
        with weight_grad_store.capture(0, 0):
            y.backward(g)
        weight_grad_store.run(0, 0)

    def timed(fn):
        out = []
        for k in range(repeats + 3):
            x.grad = w.grad = b.grad = None
            start = time.perf_counter()
            fn()
            if k >= 3:
                out.append(time.perf_counter() - start)
        return out

    t_std, t_split = [], []
    for _ in range(3):
        t_std += timed(standard)
        t_split += timed(split)
    return summary(t_split), summary(t_std)


def worker(rank, init_file, repeats, results):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=P,
                            timeout=datetime.timedelta(seconds=120))
    import torchpp  # noqa: F401

    group = dist.group.WORLD
    step_rows = bench_pairs(rank, repeats, HIDDEN, M, group)
    overhead_rows = bench_pairs(rank, repeats, TINY, TINY_M, group)
    bubbles, costs = bench_bubble(rank, repeats, group)
    split = bench_split_linear(repeats) if rank == 0 else None
    if rank == 0:
        results.put((step_rows, overhead_rows, bubbles, costs, split))
    dist.barrier()
    dist.destroy_process_group()


def fmt(s, scale=1e3, unit="ms"):
    med, lo, hi = s
    return f"{med * scale:.2f} {unit} [{lo * scale:.2f}, {hi * scale:.2f}]"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=worker, args=(r, os.path.join(tmp, "store"), args.repeats, results))
                 for r in range(P)]
        for proc in procs:
            proc.start()
        step_rows, overhead_rows, bubbles, costs, split = results.get(timeout=900)
        for proc in procs:
            proc.join()
    print(f"p={P}, CPU gloo, 1 thread per rank; median [p10, p90] over {args.repeats}+ steps\n")
    print(f"1. step time, stages of 2 x Linear({HIDDEN},{HIDDEN}), batch {BATCH}, m={M}")
    print("| schedule | torchpp | torch.distributed.pipelining | ratio torchpp/torch |\n|---|---|---|---|")
    for label, ours, theirs, _, _ in step_rows:
        print(f"| {label} | {fmt(ours)} | {fmt(theirs)} | {ours[0] / theirs[0]:.2f} |")
    print(f"\n2. engine overhead per compute action, stages of 2 x Linear({TINY},{TINY}), m={TINY_M}, microbatch of 1 row")
    print("| schedule | torchpp per action | torch per action | ratio | straight-line floor per action | "
          "torchpp overhead | torch overhead | overhead ratio |\n|---|---|---|---|---|---|---|---|")
    for label, ours, theirs, actions, floor in overhead_rows:
        per = lambda s: tuple(v / actions for v in s)  # noqa: E731
        over_ours, over_theirs = (ours[0] - floor[0]) / actions, (theirs[0] - floor[0]) / actions
        print(f"| {label} | {fmt(per(ours), 1e6, 'us')} | {fmt(per(theirs), 1e6, 'us')} | {ours[0] / theirs[0]:.2f} | "
              f"{fmt(per(floor), 1e6, 'us')} | {over_ours * 1e6:.0f} us | {over_theirs * 1e6:.0f} us | "
              f"{over_ours / over_theirs:.2f} |")
    s_split, s_std = split
    print("\n3. split B/W linear, x 2048x1024, W 1024x1024 (fp32, 1 thread)")
    print(f"I + W: {fmt(s_split)}; standard linear backward: {fmt(s_std)}; ratio {s_split[0] / s_std[0]:.3f}")
    print(f"\n4. bubble ratio, real run vs simulator from measured costs (median ms F={costs['F']:.3f}, "
          f"I={costs['I']:.3f}, W={costs['W']:.3f}, send-to-arrival {costs['comm']:.3f})")
    print("| schedule | measured bubble ratio | simulator, comm=0 | simulator, measured comm |\n|---|---|---|---|")
    for name, (measured, predicted) in bubbles.items():
        med, lo, hi = measured
        print(f"| {name} | {med:.3f} [{lo:.3f}, {hi:.3f}] | {predicted[0]:.3f} | {predicted[1]:.3f} |")


if __name__ == "__main__":
    main()
