"""Where a run's per-step figures go: a JSON-lines file, TensorBoard event files and a plot.

The JSON-lines file (one object per step, floats written exactly) is appended to by every
attempt of a run, so a resumed run continues it; readers keep the last record of each step.
"""
from __future__ import annotations

import json
import os
from typing import Dict, List, Optional


class MetricsLog:
    """Per-step records to `path` (JSON lines) and, with `tensorboard`, to TensorBoard.

    Create it on one rank only. Args:
        path: the JSON-lines file (appended to).
        tensorboard: a folder for TensorBoard event files, or None.
        resume_step: the step the run resumes after: TensorBoard drops what an earlier attempt
            wrote past it, so resumed curves do not fold back.
    """

    def __init__(self, path: str, tensorboard: Optional[str] = None, resume_step: int = 0):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.path = path
        self._file = open(path, "a")
        self.writer = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(tensorboard, purge_step=resume_step + 1 if resume_step else None)

    def write(self, step: int, **values) -> None:
        """Records `values` (numbers, or lists of numbers: one scalar each, `name/i`) for `step`."""
        self._file.write(json.dumps({"step": step, **values}) + "\n")
        self._file.flush()
        if self.writer is not None:
            for name, value in values.items():
                if isinstance(value, (list, tuple)):
                    for i, item in enumerate(value):
                        self.writer.add_scalar(f"{name}/{i}", item, step)
                elif isinstance(value, (int, float)):
                    self.writer.add_scalar(name, value, step)
            self.writer.flush()

    def close(self) -> None:
        self._file.close()
        if self.writer is not None:
            self.writer.close()


def read_metrics(path: str) -> Dict[int, dict]:
    """{step: its last record} of a JSON-lines metrics file."""
    records: Dict[int, dict] = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                record = json.loads(line)
                records[record["step"]] = {**records.get(record["step"], {}), **record}
    return records


def plot_losses(metrics_path: str, out: str, title: Optional[str] = None) -> str:
    """Plots the training loss and the held-out loss against the step, from a metrics file."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    steps = sorted(records)
    fig, ax = plt.subplots(figsize=(7, 4))
    train = [(s, records[s]["loss"]) for s in steps if "loss" in records[s]]
    held = [(s, records[s]["eval_loss"]) for s in steps if "eval_loss" in records[s]]
    for points, label, style in ((train, "training loss", "-"), (held, "held-out loss", "o-")):
        if points:
            ax.plot(*zip(*points), style, label=label, markersize=4)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per token)")
    ax.set_title(title or os.path.basename(os.path.dirname(os.path.abspath(out))))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def losses_by_step(metrics_path: str, key: str = "loss") -> Dict[int, float]:
    """{step: value of `key`} of a metrics file (last record of each step)."""
    return {s: r[key] for s, r in read_metrics(metrics_path).items() if key in r}


__all__: List[str] = ["MetricsLog", "losses_by_step", "plot_losses", "read_metrics"]
