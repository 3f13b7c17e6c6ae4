"""Text the planner prints: the top candidates as a table and why the best one wins."""
from __future__ import annotations

from torchpp.plan.planner import Candidate, Plan


def _cp(layout) -> str:
    """cp and, past 1, how attention crosses its ranks: ring, a2a (all-to-all), or a2aN+r
    (all-to-all inside groups of N, the ring across them)."""
    if layout.cp == 1:
        return "1"
    modes = {"ring": "ring", "all-to-all": "a2a", "all-to-all+ring": f"a2a{layout.cp_all_to_all_size}+r"}
    return f"{layout.cp} {modes[layout.cp_mode]}"


def _row(rank: int, c: Candidate, tokens: float) -> str:
    lay = c.layout
    return (f"{rank:>3} {lay.tp:>3} {lay.pp:>3} {_cp(lay):>9} {lay.dp:>3} {lay.micro_batch:>3} {lay.num_microbatches:>5} "
            f"{lay.chunks:>2} {lay.schedule:<17} {lay.recompute:<9} {lay.zero:<5} "
            f"{c.step_time:>9.3f} {100 * c.bubble_ratio:>7.2f} {c.memory_per_gpu / 1e9:>8.1f} {tokens / c.step_time:>12.0f}")


def format_plan(result: Plan, top: int = 10) -> str:
    """The table of the `top` candidates, then the reasons the first beats the others."""
    tokens = result.training.global_batch * result.training.seq_len
    header = (f"{'#':>3} {'tp':>3} {'pp':>3} {'cp':>9} {'dp':>3} {'b':>3} {'m':>5} {'v':>2} {'schedule':<17} "
              f"{'recompute':<9} {'zero':<5} {'step (s)':>9} {'bubble%':>7} {'mem (GB)':>8} {'tokens/s':>12}")
    lines = [f"{result.model.name}: {result.model.num_parameters / 1e9:.2f}B parameters on {result.cluster.num_gpus} GPUs "
             f"({result.cluster.gpu_memory / 1e9:.0f} GB, {result.cluster.gpus_per_node} per node), global batch "
             f"{result.training.global_batch} x {result.training.seq_len} tokens; compute at "
             f"{100 * result.cluster.efficiency:.0f}% of {result.cluster.peak_flops / 1e12:.0f} TFLOP/s",
             f"{len(result.ranked)} layouts ranked; rejected: " +
             (", ".join(f"{n} {why}" for why, n in sorted(result.rejected.items())) or "none"), "", header]
    lines += [_row(k + 1, c, tokens) for k, c in enumerate(result.ranked[:top])]
    lines += ["", why_best(result)]
    return "\n".join(lines)


def why_best(result: Plan) -> str:
    """Compares the best with the fastest candidate of each other (tp, pp) shape, cause by cause."""
    best = result.best
    lines = [f"Why #1 wins: step {best.step_time:.3f} s = " +
             " + ".join(f"{name} {seconds:.3f}" for name, seconds in best.breakdown.items()) +
             f"; {best.memory_per_gpu / 1e9:.1f} GB on the fullest GPU."]
    seen = {(best.layout.tp, best.layout.pp, _cp(best.layout))}
    for other in result.ranked[1:]:
        shape = (other.layout.tp, other.layout.pp, _cp(other.layout))
        if shape in seen:
            continue
        seen.add(shape)
        deltas = {name: other.breakdown[name] - best.breakdown[name] for name in best.breakdown}
        worst = max(deltas, key=deltas.get)
        lines.append(f"  vs tp={shape[0]} pp={shape[1]} cp={shape[2]} (best {other.step_time:.3f} s, "
                     f"+{100 * (other.step_time / best.step_time - 1):.1f}%): mostly {worst} "
                     f"+{deltas[worst]:.3f} s")
        if len(seen) > 4:
            break
    return "\n".join(lines)
