"""Timeline picture of a simulated schedule: ranks as rows, a box per action."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torchpp.schedule.simulation import Simulation

# One colour per action type, the zero-bubble paper's palette in spirit: F blue, I/B
# teal/green, W purple.
COLOURS = {"F": "#4c72b0", "I": "#55a868", "B": "#2a7f62", "W": "#8172b3"}
ROW_INCHES = 0.6  # height of one rank's row


def plot_timeline(sim: "Simulation", path: str, title: str | None = None, unit: str = "cost units") -> None:
    """Draws ``sim`` into ``path`` with matplotlib (Agg, no display needed).

    The figure's width follows the number of actions per rank (not the makespan, whose unit
    may be anything), each rank gets a row tall enough to read, and a box wide enough is
    labelled with its action type and microbatch.

    Args:
        sim: the simulation to draw (or a real run's, from torchpp.pipeline.trace).
        path: image file to write.
        title: figure title; defaults to schedule name, sizes, bubble ratio and peak memory.
        unit: the unit of ``sim``'s times, for the time axis ("ms" for a real run).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    sch = sim.schedule
    ranks = sch.num_ranks
    actions = max((len(line) for line in sim.timeline), default=1)
    width = min(max(8.0, 0.3 * actions), 24.0)  # inches: about 0.3 per action, so labels fit
    fig, ax = plt.subplots(figsize=(width, ROW_INCHES * ranks + 1.6))
    points_per_unit = width * 72 / max(sim.makespan, 1e-9)  # to size labels
    for rank, line in enumerate(sim.timeline):
        for action, kind, stage, microbatch, start, end in line:
            # Second stage of a rank (interleaved, V, DualPipe) is drawn lighter.
            first_stage = sch.stage_to_rank.index(rank)
            alpha = 1.0 if stage == first_stage else 0.6
            ax.barh(rank, end - start, left=start, height=0.85, color=COLOURS[kind], alpha=alpha,
                    edgecolor="white", linewidth=0.5)
            box = (end - start) * points_per_unit
            label = f"{kind}{microbatch}" if box >= 16 else str(microbatch) if box >= 8 else None
            if label is not None:
                ax.text((start + end) / 2, rank, label, ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(ranks), [f"rank {r}" for r in range(ranks)])
    ax.set_ylim(ranks - 0.5, -0.5)  # rank 0 on top
    ax.set_xlim(0, sim.makespan)
    ax.set_xlabel(f"time ({unit})")
    if title is None:
        title = (f"{sch.name}  p={ranks} m={sch.num_microbatches} stages={sch.num_stages}  "
                 f"bubble ratio {sim.bubble_ratio:.3f}  peak activations {max(sim.peak_activations)}")
    ax.set_title(title, fontsize=10)
    kinds = sorted({kind for line in sim.timeline for _, kind, *_ in line}, key="FIBW".index)
    ax.legend(handles=[Patch(color=COLOURS[k], label=k) for k in kinds], loc="upper left",
              bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
