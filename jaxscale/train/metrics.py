"""A run's metrics: metrics.jsonl (one object per line), TensorBoard event files and the loss plot,
all in the run directory and written by process 0."""
from __future__ import annotations

import json
import os
from pathlib import Path

import jax

from jaxscale.train.tb_events import EventWriter


class MetricsWriter:
    """metrics.jsonl (one object per line) and TensorBoard event files in the run directory.

    `resume_step=s` keeps the rows with step <= s (rewritten atomically) and appends after them;
    TensorBoard is told to purge events after step s."""

    def __init__(self, out: Path, resume_step: int | None = None):
        self.out = out
        self._jsonl = None
        self._tb = None
        self.kept: list[dict] = []
        if jax.process_index() == 0:
            path = out / "metrics.jsonl"
            if resume_step is not None and path.exists():
                self.kept = [r for r in read_metrics(path) if r.get("step", 0) <= resume_step]
                tmp = path.with_suffix(".jsonl.tmp")
                tmp.write_text("".join(json.dumps(r) + "\n" for r in self.kept))
                os.replace(tmp, path)
            self._jsonl = open(path, "a" if resume_step is not None else "w")
            self._tb = EventWriter(out / "tb", purge_step=(
                resume_step + 1 if resume_step is not None else None))

    def write(self, row: dict) -> None:
        if self._jsonl is None:
            return
        self._jsonl.write(json.dumps(row) + "\n")
        self._jsonl.flush()
        self._tb.scalars(row["step"], {k: v for k, v in row.items()
                                       if k != "step" and isinstance(v, (int, float))})

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._tb.close()


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def plot_loss(rows: list[dict], path: Path, title: str = "") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    kept = {r["step"]: r["loss"] for r in rows       # the last row of a step: after a rollback,
            if "loss" in r and r.get("event") not in ("spike", "rollback")}   # the run that held
    train = sorted(kept.items())
    ev = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
    spikes = [(r["step"], r["loss"]) for r in rows if r.get("event") in ("spike",
                                                                        "spike_skipped")]
    fig, ax = plt.subplots(figsize=(6, 4))
    if train:
        ax.plot(*zip(*train), label="train loss", lw=1)
    if spikes:
        ax.plot(*zip(*spikes), "rx", label="loss spike (skipped or rolled back)")
    if ev:
        ax.plot(*zip(*ev), "o-", label="held-out loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross entropy (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
