"""Pipeline runtime figures (p=2, CPU gloo), every comparison within one run.

  1. Step time of torchpp vs torch.distributed.pipelining: same model, same schedule
     (1F1B, interleaved 1F1B, the zero-bubble ZB-V and interleaved zero bubble), the two
     engines alternating step by step; the ratio is the median of the per-pair ratios torchpp / torch. Two microbatch
     counts for the same batch: m=8 and m=32.
  2. Engine overhead per compute action: tiny stages, m=64. Overhead = CPU time of the rank's
     thread during a step minus the CPU time of the same stage computations (forward, loss,
     backward of plain nn.Linear stages) run back to back with no engine and no messages, with
     the other rank idle. What is left is each engine's own work: scheduling, bookkeeping,
     microbatching, and posting/completing its messages. CPU time, not wall time, so the gloo
     latency both engines wait on (and this box's scheduling noise) does not count. Reported
     twice: the calling thread's CPU, and the whole process's (gloo's own threads included,
     so work either engine leaves to them counts too).
  3. Split B/W linear: I + W time over a standard linear backward at a large size.
  4. Real measured bubble of zb-h1 and 1f1b against the simulator's prediction from the
     measured F/I/W costs and the transport's measured latency, with passes short (as in 1.)
     and long against that latency.
  5. Tuple messages: 1F1B step time when stage 0 passes a tuple (hidden, residual, bool mask)
     to stage 1. torchpp packs the tuple into one message; torch sends each tensor.

    PYTHONPATH=. python bench/bench_pipeline.py [--repeats 60] [--no-pin] [--sections 12345]
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
STEP_MS = (M, 32)  # microbatch counts of section 1; the batch stays BATCH rows
TINY, TINY_M = 4, 64
BUBBLE_SIZES = ((HIDDEN, BATCH), (1024, 256))  # (width, batch): passes a few times a message's cost, and long against it
# (label, torchpp schedule, torch class name, stages per rank, placement)
PAIRS = [
    ("1F1B", "1f1b", "Schedule1F1B", 1, "single"),
    ("interleaved 1F1B (v=2)", "interleaved-1f1b", "ScheduleInterleaved1F1B", 2, "loop"),
    ("zero bubble ZB-V", "zb-v", "ScheduleZBVZeroBubble", 2, "v"),
    ("interleaved zero bubble (v=2)", "interleaved-zb", "ScheduleInterleavedZeroBubble", 2, "loop"),
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


def timed_step(step):
    """Wall and this thread's CPU seconds of one step, barriers outside the timing."""
    dist.barrier()
    times = timed_step_local(step)
    dist.barrier()
    return times


def summary(times):
    ordered = sorted(times)
    return statistics.median(ordered), ordered[len(ordered) // 10], ordered[-1 - len(ordered) // 10]


def batch_rows(width, m):
    return BATCH if width == HIDDEN else m


def torchpp_step_fn(name, width, m, ids, num_stages, group, split=None, batch=None, in_order_p2p=None):
    """torchpp's step on this rank's stages. The stages are exactly torch's model (nn.Linear)
    except under zero-bubble schedules, whose W passes need torchpp's split-B/W linears."""
    from torchpp.pipeline import PipelineStage, build_schedule

    split = "zb" in name if split is None else split
    stages = [PipelineStage(stage_module(width, split, s), s, num_stages, "cpu", group=group) for s in ids]
    sched = build_schedule(name, stages, m, loss_fn=F.mse_loss, in_order_p2p=in_order_p2p)
    rows = batch or batch_rows(width, m)
    x, y = torch.randn(rows, width), torch.randn(rows, width)
    return (lambda: sched.step(x, target=y)), sched


def torch_step_fn(cls_name, width, m, ids, num_stages, group, library="torch"):
    """The step of torch's program: its stage and schedule classes, imported from torch, or
    (library="torchpp") from torchpp.pipeline with nothing else changed (the migration)."""
    if library == "torch":
        from torch.distributed import pipelining as tpp
    else:
        import torchpp.pipeline as tpp

    stages = [tpp.PipelineStage(stage_module(width, False, s), s, num_stages, torch.device("cpu"), group=group)
              for s in ids]
    cls = getattr(tpp, cls_name)
    sched = cls(stages if len(stages) > 1 else stages[0], m, loss_fn=F.mse_loss)
    x, y = torch.randn(batch_rows(width, m), width), torch.randn(batch_rows(width, m), width)
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


def compute_floor_fn(name, per_rank, m, ids, num_stages, num_ranks=P, rank=None):
    """This rank's stage computations in schedule order with no engine and no messages: each F
    runs the stage forward (and the loss on the last stage), each B or I a full backward of
    plain nn.Linear stages (W then has nothing left). Plain linears also for ZB-V, where
    torchpp runs split ones, so the split op's own cost counts against torchpp."""
    from torchpp import schedule as S
    from torchpp.pipeline.trace import parse_action

    sch = S.generate(name, num_ranks=num_ranks, num_microbatches=m, num_chunks=per_rank)
    actions = [parse_action(a) for a in sch.lowered().actions(dist.get_rank() if rank is None else rank)]
    modules = {s: stage_module(TINY, False, s) for s in ids}
    x, y = torch.randn(m, TINY).chunk(m), torch.randn(m, TINY).chunk(m)
    grad, seed = torch.randn(1, TINY), torch.randn(1, TINY)

    def step():
        outputs = {}
        for stage, kind, mb in actions:
            if kind == "F":
                # A fresh leaf as the engines make of a received activation.
                inp = x[mb] if stage == 0 else seed.detach().requires_grad_()
                out = modules[stage](inp)
                outputs[(stage, mb)] = F.mse_loss(out, y[mb]) if stage == num_stages - 1 else out
            elif kind in ("B", "I"):
                out = outputs.pop((stage, mb))
                out.backward(None if stage == num_stages - 1 else grad)
    return step


def timed_step_local(step):
    """Wall seconds, this thread's CPU seconds and the whole process's CPU seconds (gloo's own
    threads included, so work that either engine leaves to them counts) of one step."""
    wall, cpu, proc = time.perf_counter(), time.thread_time(), time.process_time()
    step()
    return time.perf_counter() - wall, time.thread_time() - cpu, time.process_time() - proc


def alone(step):
    """Thread and process CPU seconds of one `step` on this rank, run while every other rank
    waits its turn."""
    cpu = None
    for turn in range(P):
        dist.barrier()
        if dist.get_rank() == turn:
            cpu = timed_step_local(step)[1:]
    dist.barrier()
    return cpu


def bench_pairs(rank, repeats, width, m, group, dropin=False):
    rows = []
    for label, name, cls_name, per_rank, placement in PAIRS:
        ids = stage_ids(rank, per_rank, placement)
        num_stages = P * per_rank
        if dropin:  # torch's program, its imports switched to torchpp.pipeline
            ours = torch_step_fn(cls_name, width, m, ids, num_stages, group, library="torchpp")
        else:
            ours, _ = torchpp_step_fn(name, width, m, ids, num_stages, group)
        theirs = torch_step_fn(cls_name, width, m, ids, num_stages, group)
        floor = compute_floor_fn(name, per_rank, m, ids, num_stages) if width == TINY else None
        for _ in range(3):  # warm up all
            timed_step(ours)
            timed_step(theirs)
            if floor is not None:
                alone(floor)
        # Alternate step by step so the machine's drift hits both engines (and the floor) alike,
        # and swap which engine goes first every other pair so neither always follows the other.
        wall = {"ours": [], "theirs": []}
        cpu = {"ours": [], "theirs": [], "floor": []}
        proc = {"ours": [], "theirs": [], "floor": []}
        engines = (("ours", ours), ("theirs", theirs))
        for k in range(repeats):
            for key, fn in engines if k % 2 == 0 else engines[::-1]:
                w, c, pc = timed_step(fn)
                wall[key].append(w)
                cpu[key].append(c)
                proc[key].append(pc)
            if floor is not None:
                c, pc = alone(floor)
                cpu["floor"].append(c)
                proc["floor"].append(pc)
        actions = 2 * m * per_rank if "zb" not in name else 3 * m * per_rank  # F+B, or F+I+W
        rows.append({"label": label, "m": m, "wall": wall, "cpu": cpu, "proc": proc, "actions": actions})
    return rows


class TupleFirst(nn.Module):
    """Stage 0 of section 5: three tensors to the next stage, one of them bool."""

    def __init__(self, width: int):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        h = self.fc(x)
        return h, torch.tanh(h), x[:, 0] > -1.0


class TupleLast(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, h, skip, keep):
        return self.fc(h + skip) * keep[:, None]


def bench_tuples(rank, repeats, group):
    """Section 5: the same tuple-passing stages under both engines' 1F1B, alternating."""
    from torch.distributed import pipelining as tpp

    from torchpp.pipeline import PipelineStage, build_schedule

    def module():
        torch.manual_seed(rank)
        return TupleFirst(HIDDEN) if rank == 0 else TupleLast(HIDDEN)

    x, y = torch.randn(BATCH, HIDDEN), torch.randn(BATCH, HIDDEN)
    ours = build_schedule("1f1b", PipelineStage(module(), rank, P, "cpu", group=group), M, loss_fn=F.mse_loss)
    theirs = tpp.Schedule1F1B(tpp.PipelineStage(module(), rank, P, torch.device("cpu"), group=group), M,
                              loss_fn=F.mse_loss)
    steps = {"ours": lambda: ours.step(*([x] if rank == 0 else []), target=y if rank == 1 else None),
             "theirs": lambda: theirs.step(*([x] if rank == 0 else []), target=y if rank == 1 else None)}
    wall = {"ours": [], "theirs": []}
    for k in range(repeats + 3):  # the first three pairs warm up
        for key in ("ours", "theirs") if k % 2 == 0 else ("theirs", "ours"):
            elapsed = timed_step(steps[key])[0]
            if k >= 3:
                wall[key].append(elapsed)
    return wall


def bench_engine_alone(repeats, group):
    """Rank 0 alone (a one-rank pipeline group): every stage on one rank, so no messages at
    all; CPU per compute action minus the compute floor is the engine's bookkeeping alone."""
    rows = []
    for label, name, cls_name, per_rank, _ in PAIRS:
        ids = list(range(per_rank))
        ours, _ = torchpp_step_fn(name, TINY, TINY_M, ids, per_rank, group)
        theirs = torch_step_fn(cls_name, TINY, TINY_M, ids, per_rank, group)
        floor = compute_floor_fn(name, per_rank, TINY_M, ids, per_rank, num_ranks=1, rank=0)
        cpu = {"ours": [], "theirs": [], "floor": []}
        for k in range(repeats + 3):
            for key, fn in (("ours", ours), ("theirs", theirs), ("floor", floor)):
                c = timed_step_local(fn)[1]
                if k >= 3:
                    cpu[key].append(c)
        actions = 2 * TINY_M * per_rank if "zb" not in name else 3 * TINY_M * per_rank
        rows.append((label, {k: statistics.median(v) * 1e6 / actions for k, v in cpu.items()}))
    return rows


def one_way_latency_ms(rank, group, shape, repeats=60):
    """Half the median round trip of one activation-sized tensor between ranks 0 and 1, each
    receive posted before the trip starts, as the executor posts them ahead of their use."""
    trips = []
    peer = dist.get_global_rank(group, 1 - rank)
    for _ in range(repeats):
        inbox, outbox = torch.empty(shape), torch.zeros(shape)
        pending = dist.irecv(inbox, peer, group=group)
        dist.barrier(group)
        start = time.perf_counter()
        if rank == 0:
            dist.send(outbox, peer, group=group)
            pending.wait()
        else:
            pending.wait()
            dist.send(outbox, peer, group=group)
        trips.append(time.perf_counter() - start)
    return statistics.median(trips) / 2 * 1e3


def bench_bubble(rank, repeats, group, width, batch):
    """Measured bubble ratios of zb-h1 and 1f1b, and the simulator's from the zb-h1 run's median
    F/I/W spans per stage (the last stage's include the loss), with no latency and with the
    measured one. Also the part of the measured bubble the busiest rank's compute thread spent
    posting messages (SEND/RECV actions), a cost the simulator does not model."""
    from torchpp import schedule as S
    from torchpp.pipeline.trace import COMPUTE, gather_runs, measured_simulation, parse_action

    out = {}
    costs = {"comm": one_way_latency_ms(rank, group, (batch // M, width))}
    for name in ("zb-h1", "1f1b"):
        step, sched = torchpp_step_fn(name, width, M, [rank], P, group, split=True, batch=batch)
        ratios, posting, spans = [], [], {}
        for _ in range(repeats):
            dist.barrier()
            step()
            runs = gather_runs(sched, group)
            sim = measured_simulation(sched, runs)
            ratios.append(sim.bubble_ratio)
            for line in sim.timeline:
                for _a, kind, stage, _m, start, end in line:
                    spans.setdefault((kind, stage), []).append(end - start)
            busiest = max(range(P), key=lambda r: sim.busy[r])
            messages = [end - start for action, start, end, _ in runs[busiest]["timeline"]
                        if parse_action(action)[1] not in COMPUTE]
            makespan = max(line[-1][5] - line[0][4] for line in sim.timeline)
            posting.append(sum(messages) / 1e3 / makespan)
        if name == "zb-h1":
            costs.update({kind: [statistics.median(spans[kind, s]) for s in range(P)] for kind in "FIW"})
        predicted = [S.simulate(sched.schedule, f=costs["F"], i=costs["I"], w=costs["W"], comm=comm).bubble_ratio
                     for comm in (0.0, costs["comm"])]
        out[name] = (summary(ratios), statistics.median(posting), predicted)
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
        x.grad = w.grad = b.grad = None
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    for _ in range(3):  # warm-up
        timed(standard), timed(split)
    # Paired and alternating (which runs first swaps every pair), so drift hits both alike.
    t_std, t_split = [], []
    for k in range(repeats):
        first, second = (standard, split) if k % 2 == 0 else (split, standard)
        a, b_time = timed(first), timed(second)
        t_std.append(a if first is standard else b_time)
        t_split.append(b_time if first is standard else a)
    return t_split, t_std


def worker(rank, init_file, repeats, pin, sections, results, dropin=False):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    if pin:  # rank r on core r, as a launcher binds ranks; gloo's threads inherit it
        os.sched_setaffinity(0, {rank % os.cpu_count()})
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=P,
                            timeout=datetime.timedelta(seconds=120))
    import torchpp  # noqa: F401

    group = dist.group.WORLD
    out = {}
    if "1" in sections:
        out["step"] = [row for m in STEP_MS for row in bench_pairs(rank, repeats, HIDDEN, m, group, dropin)]
    if "2" in sections:
        out["overhead"] = bench_pairs(rank, repeats, TINY, TINY_M, group)
    if "4" in sections:
        out["bubble"] = [bench_bubble(rank, max(repeats // 2, 5), group, w, b) for w, b in BUBBLE_SIZES]
    if "5" in sections:
        out["tuples"] = bench_tuples(rank, repeats, group)
    alone_group = dist.new_group([0])
    if rank == 0 and "3" in sections:
        out["split"] = bench_split_linear(repeats)
    if rank == 0 and "2" in sections:
        out["alone"] = bench_engine_alone(repeats, alone_group)
    results.put((rank, out))
    dist.barrier()
    dist.destroy_process_group()


def fmt(s, scale=1e3, unit="ms"):
    med, lo, hi = s
    return f"{med * scale:.2f} {unit} [{lo * scale:.2f}, {hi * scale:.2f}]"


def paired_ratio(ours, theirs):
    """Median [p10, p90] of the per-pair ratios ours/theirs."""
    return summary([a / b for a, b in zip(ours, theirs)])


def print_step_rows(rows):
    print(f"1. step time, stages of 2 x Linear({HIDDEN},{HIDDEN}), batch {BATCH} (rank 0's wall clock)")
    print("| schedule | m | torchpp | torch.distributed.pipelining | paired ratio torchpp/torch |\n"
          "|---|---|---|---|---|")
    for row in rows:
        ratio = paired_ratio(row["wall"]["ours"], row["wall"]["theirs"])
        print(f"| {row['label']} | {row['m']} | {fmt(summary(row['wall']['ours']))} | "
              f"{fmt(summary(row['wall']['theirs']))} | {fmt(ratio, 1, '')} |")


def print_overhead_rows(per_rank_rows, clock="cpu"):
    title = {"cpu": "CPU time of the rank's thread that calls step()",
             "proc": "CPU time of the whole rank process, gloo's own threads included"}[clock]
    print(f"\n2. engine overhead per compute action ({title}), stages of 2 x Linear({TINY},{TINY}), m={TINY_M}, "
          "microbatches of one row; mean over the ranks of their medians; the ratio is the median [p10, p90] "
          "over the iterations (a torchpp step, a torch step, the floor on each rank)")
    print("| schedule | wall per action torchpp / torch | CPU per action torchpp / torch | compute floor | "
          "overhead torchpp | overhead torch | overhead ratio |\n|---|---|---|---|---|---|---|")
    for rows in zip(*per_rank_rows):
        label, actions = rows[0]["label"], rows[0]["actions"]
        per_action = lambda values: sum(values) / len(values) * 1e6 / actions  # noqa: E731
        wall = {k: per_action([statistics.median(r["wall"][k]) for r in rows]) for k in ("ours", "theirs")}
        cpu = {k: per_action([statistics.median(r[clock][k]) for r in rows]) for k in ("ours", "theirs", "floor")}
        over = {k: cpu[k] - cpu["floor"] for k in ("ours", "theirs")}
        # Per iteration, each quantity averaged over the ranks.
        iters = [{k: sum(r[clock][k][i] for r in rows) for k in ("ours", "theirs", "floor")}
                 for i in range(len(rows[0][clock]["floor"]))]
        ratios = summary([(it["ours"] - it["floor"]) / (it["theirs"] - it["floor"]) for it in iters])
        print(f"| {label} | {wall['ours']:.0f} / {wall['theirs']:.0f} us | {cpu['ours']:.0f} / {cpu['theirs']:.0f} us | "
              f"{cpu['floor']:.0f} us | {over['ours']:.0f} us | {over['theirs']:.0f} us | {fmt(ratios, 1, '')} |")


def print_bubble_rows(sizes):
    print("\n4. bubble ratio, real run vs the simulator from the zb-h1 run's median F/I/W spans per stage and "
          "the measured one-way latency of one activation (half a ping-pong, receive posted)")
    print("| stages, microbatch | F / I / W per stage, latency (ms) | schedule | measured bubble ratio | "
          "of which posting messages | simulator, comm=0 | simulator, latency |\n|---|---|---|---|---|---|---|")
    for (width, batch), (bubbles, costs) in zip(BUBBLE_SIZES, sizes):
        per_stage = " / ".join(",".join(f"{c:.2f}" for c in costs[kind]) for kind in "FIW")
        for name, (measured, posting, predicted) in bubbles.items():
            med, lo, hi = measured
            print(f"| 2 x Linear({width},{width}), {batch // M} rows | {per_stage}, {costs['comm']:.3f} | {name} | "
                  f"{med:.3f} [{lo:.3f}, {hi:.3f}] | {posting:.3f} | {predicted[0]:.3f} | {predicted[1]:.3f} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=60)
    parser.add_argument("--no-pin", dest="pin", action="store_false",
                        help="leave rank placement to the OS scheduler (default: rank r on core r)")
    parser.add_argument("--sections", default="12345", help="which of the sections 1-5 to run (default: all)")
    parser.add_argument("--dropin", action="store_true",
                        help="section 1 runs torch's program with its imports switched to torchpp.pipeline (torch's "
                             "classes and calls, torchpp's executor) instead of build_schedule")
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=worker,
                             args=(r, os.path.join(tmp, "store"), args.repeats, args.pin, args.sections, results,
                                   args.dropin))
                 for r in range(P)]
        for proc in procs:
            proc.start()
        by_rank = dict(results.get(timeout=1800) for _ in range(P))
        for proc in procs:
            proc.join()
    out = by_rank[0]
    placement = "rank r pinned to core r" if args.pin else "ranks placed by the OS"
    print(f"p={P}, CPU gloo, 1 thread per rank, {placement}; median [p10, p90] over {args.repeats} steps per engine\n")
    if "step" in out:
        print_step_rows(out["step"])
    if "overhead" in out:
        for clock in ("cpu", "proc"):
            print_overhead_rows([by_rank[r]["overhead"] for r in range(P)], clock)
        print("\n2b. the same with no transport: every stage on one rank (a one-rank group), CPU per compute action")
        print("| schedule | torchpp | torch | compute floor | overhead torchpp | overhead torch | overhead ratio |\n"
              "|---|---|---|---|---|---|---|")
        for label, cpu in out["alone"]:
            ours, theirs = cpu["ours"] - cpu["floor"], cpu["theirs"] - cpu["floor"]
            print(f"| {label} | {cpu['ours']:.0f} us | {cpu['theirs']:.0f} us | {cpu['floor']:.0f} us | "
                  f"{ours:.0f} us | {theirs:.0f} us | {ours / theirs:.2f} |")
    if "split" in out:
        t_split, t_std = out["split"]
        print("\n3. split B/W linear, x 2048x1024, W 1024x1024 (fp32, 1 thread), forward + backward")
        print(f"I + W: {fmt(summary(t_split))}; standard linear backward: {fmt(summary(t_std))}; "
              "paired ratio {:.3f} [{:.3f}, {:.3f}]".format(*paired_ratio(t_split, t_std)))
    if "bubble" in out:
        print_bubble_rows(out["bubble"])
    if "tuples" in out:
        wall = out["tuples"]
        print(f"\n5. tuple messages, 1F1B m={M}: stage 0 passes (hidden, residual, bool mask), stages of "
              f"Linear({HIDDEN},{HIDDEN}), batch {BATCH} (rank 0's wall clock)")
        print("| torchpp (one packed message per microbatch) | torch.distributed.pipelining (one per tensor) | "
              "paired ratio torchpp/torch |\n|---|---|---|")
        print(f"| {fmt(summary(wall['ours']))} | {fmt(summary(wall['theirs']))} | "
              f"{fmt(paired_ratio(wall['ours'], wall['theirs']), 1, '')} |")


if __name__ == "__main__":
    main()
