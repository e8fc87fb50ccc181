"""The training loop: progress bar, metrics (JSONL + TensorBoard), held-out evaluation, loss plot.

Per step it reports loss, gradient norm, learning rate, tokens/s, step time and MFU, where
MFU = model FLOPs per token (`ModelConfig.flops_per_token`: 6 x matmul parameters + causal
attention) x tokens/s / (peak FLOP/s per device x devices); the peak comes from
`jaxscale.hardware` for `mesh.device_kind` and the compute dtype, or from `train.peak_flops`.
Step times exclude the first step (compilation) from tokens/s.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import jax
import numpy as np

from jaxscale import config as config_lib
from jaxscale import hardware
from jaxscale.data import Batches, load_corpus
from jaxscale.train.setup import build


class MetricsWriter:
    """metrics.jsonl (one object per line) and TensorBoard event files in the run directory."""

    def __init__(self, out: Path):
        self.out = out
        self._jsonl = None
        self._tb = None
        if jax.process_index() == 0:
            self._jsonl = open(out / "metrics.jsonl", "w")
            from tensorboardX import SummaryWriter
            self._tb = SummaryWriter(str(out / "tb"))

    def write(self, row: dict) -> None:
        if self._jsonl is None:
            return
        self._jsonl.write(json.dumps(row) + "\n")
        self._jsonl.flush()
        for k, v in row.items():
            if k != "step" and isinstance(v, (int, float)):
                self._tb.add_scalar(k, v, row["step"])

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
    train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    ev = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
    fig, ax = plt.subplots(figsize=(6, 4))
    if train:
        ax.plot(*zip(*train), label="train loss", lw=1)
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


def evaluate(setup, params, batches: Batches, n: int) -> float:
    total, count = 0.0, 0.0
    sh = setup.batch_shardings()
    for i in range(n):
        s, c = setup.eval_step(params, batches.device_batch(i, sh))
        total, count = total + float(s), count + float(c)
    return total / max(count, 1.0)


def train(cfg, out: Path | None = None, progress: bool = True) -> dict:
    """Run `cfg` to `cfg.train.steps`; returns a summary dict."""
    out = Path(out or cfg.train.out or f"runs/{cfg.name}")
    out.mkdir(parents=True, exist_ok=True)
    setup = build(cfg)
    cfg = config_lib.replace_resolved_mesh(cfg, setup.plan.mesh_cfg)
    if jax.process_index() == 0:
        config_lib.save(cfg, out / "config.json")
    corpus = load_corpus(cfg.data)
    train_b = Batches(corpus.train, cfg.data.batch_size, cfg.data.seq_len, cfg.data.seed)
    eval_b = Batches(corpus.heldout, cfg.data.batch_size, cfg.data.seq_len, cfg.data.seed, 1)
    n_dev = jax.device_count()
    peak = cfg.train.peak_flops or hardware.peak_flops_per_device(
        cfg.mesh.device_kind, cfg.model.dtype, n_dev)
    tokens_per_step = cfg.data.batch_size * cfg.data.seq_len
    flops_per_step = cfg.model.flops_per_token(cfg.data.seq_len) * tokens_per_step

    state = setup.init_state()
    writer = MetricsWriter(out)
    sh = setup.batch_shardings()
    bar = None
    if progress and jax.process_index() == 0:
        from tqdm import tqdm
        bar = tqdm(total=cfg.train.steps, desc=cfg.name, unit="step", dynamic_ncols=True)
    first_eval = last_eval = None
    timed_tokens, timed_secs = 0, 0.0
    try:
        for step in range(cfg.train.steps):
            batch = train_b.device_batch(step, sh)
            t0 = time.perf_counter()
            state, m = setup.train_step(state, batch)
            m = jax.device_get(m)
            dt = time.perf_counter() - t0
            if step > 0:
                timed_tokens += tokens_per_step
                timed_secs += dt
            tps = tokens_per_step / dt
            row = {"step": step + 1, "loss": float(m["loss"]), "grad_norm": float(m["grad_norm"]),
                   "lr": float(m["lr"]), "tokens_per_s": tps, "step_time_s": dt,
                   "mfu": flops_per_step / dt / (peak * n_dev)}
            if cfg.train.eval_every and ((step + 1) % cfg.train.eval_every == 0 or step == 0
                                         or step + 1 == cfg.train.steps):
                row["eval_loss"] = evaluate(setup, state.params, eval_b, cfg.train.eval_batches)
                first_eval = row["eval_loss"] if first_eval is None else first_eval
                last_eval = row["eval_loss"]
            if not np.isfinite(row["loss"]):
                raise FloatingPointError(f"non-finite loss {row['loss']} at step {step + 1}")
            if (step + 1) % cfg.train.log_every == 0 or "eval_loss" in row:
                writer.write(row)
            if bar is not None:
                post = {"loss": f"{row['loss']:.3f}", "tok/s": f"{tps:,.0f}",
                        "mfu": f"{100 * row['mfu']:.1f}%"}
                if last_eval is not None:
                    post["eval"] = f"{last_eval:.3f}"
                bar.set_postfix(post)
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
        writer.close()
    summary = {"steps": cfg.train.steps, "first_eval_loss": first_eval, "last_eval_loss": last_eval,
               "tokens_per_s": timed_tokens / timed_secs if timed_secs else None,
               "mfu": (flops_per_step * timed_tokens / tokens_per_step / timed_secs / (peak * n_dev)
                       if timed_secs else None), "out": str(out)}
    if jax.process_index() == 0:
        plot_loss(read_metrics(out / "metrics.jsonl"), out / "loss.png", cfg.name)
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
