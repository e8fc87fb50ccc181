"""Experiment 28's recovery parts (imported by `28_fault_tolerance.py`, after its 8 simulated
devices are set up):

- `resume_time`: a streamed, packed data source (`data.shards` of the stdlib's text) resumed at
  step S from the data state a checkpoint holds, against replaying the stream from the start;
  both give the same next batch, bitwise.
- `spikes`: llama_tiny trained 60 steps with a window of bad batches (targets scrambled) under
  `train.spike_policy` off, skip and rollback, beside the run without them; the steps lost and
  the wall time each recovery took.
- `restarts`: `jaxscale launch --processes 2 --max-restarts 1` with process 1 killed -9 after
  the step-10 checkpoint, restarted on the same two processes, and with `--elastic` on one;
  the steps lost, the wall time from the kill to the first step after it, and the final loss
  beside the uninterrupted run's.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

BAD = (30, 31, 32)              # the batches whose targets are scrambled
SPIKE_STEPS = 60


def _shards(out: Path) -> Path:
    from jaxscale.data import corpus_files, shards, tokenizer
    d = out / "shards"
    if not (d / "manifest.json").exists():
        shards.prepare(corpus_files("stdlib"), tokenizer.ByteTokenizer(), d,
                       heldout_fraction=0.02, source="stdlib")
    return d


def resume_time(out: Path, steps=(10, 100, 1000, 5000), batch: int = 32, seq: int = 256) -> list:
    """Per step S: seconds to reach batch S+1 from the saved data state, and by replaying."""
    from jaxscale.data.stream import PackedBatches
    d = _shards(out)
    rows = []
    for s in steps:
        a = PackedBatches(d, "train", batch, seq, seed=0, process_index=0, process_count=1)
        t0 = time.perf_counter()
        a.global_pieces(s - 1)                 # a fresh process with no state: replay
        a.local_rows(s)
        replay = time.perf_counter() - t0
        state = json.loads(json.dumps(a.state()))
        want = a.local_rows(s + 1)
        b = PackedBatches(d, "train", batch, seq, seed=0, process_index=0, process_count=1)
        t0 = time.perf_counter()
        b.restore(state)
        got = b.local_rows(s + 1)
        restore = time.perf_counter() - t0
        rows.append({"step": s, "replay_s": replay, "restore_s": restore,
                     "state_bytes": len(json.dumps(state)),
                     "lengths_read_on_restore": b.stream.lengths_read,
                     "equal": all(np.array_equal(got[k], want[k]) for k in want)})
        print(f"  resume at step {s}: replay {replay:.3f} s, from the state {restore:.4f} s",
              flush=True)
    return rows


class _Bad:
    """Training batches with BAD's targets scrambled (finite, far above the loss)."""

    def __init__(self, inner):
        self.inner = inner

    def device_batch(self, i, shardings):
        import jax
        batch = self.inner.device_batch(i, shardings)
        if i in BAD:
            rng = np.random.default_rng(i)
            batch["targets"] = jax.device_put(rng.integers(0, 256, batch["targets"].shape,
                                                           dtype=np.int32), shardings["targets"])
        return batch


def spikes(out: Path, config) -> dict:
    """Four runs: clean, and bad batches under each policy. `config(*overrides)` is the tiny
    LLaMA config (experiment 28's)."""
    from jaxscale.train import loop
    from jaxscale.train.metrics import read_metrics
    real = loop.make_batches
    runs = {"clean": (), "policy off": ("train.spike_policy=off",),
            "skip": ("train.spike_policy=skip",),
            "rollback": ("train.spike_policy=rollback", "train.max_rollbacks=5")}
    res = {}
    try:
        for name, extra in runs.items():
            loop.make_batches = (real if name == "clean" else
                                 lambda data: (lambda b: (_Bad(b[0]), b[1]))(real(data)))
            run = out / "spikes" / name.replace(" ", "_")
            shutil.rmtree(run, ignore_errors=True)
            t0 = time.perf_counter()
            summary = loop.train(config(f"train.steps={SPIKE_STEPS}", "ckpt.every=10",
                                        "ckpt.async_save=false", "train.spike_window=8",
                                        "train.eval_every=20", "train.eval_batches=4", *extra),
                                 run, progress=False)
            rows = read_metrics(run / "metrics.jsonl")
            final = {r["step"]: r["loss"] for r in rows        # the kept run's rows
                     if r.get("event") not in ("spike", "rollback")}
            events = [r for r in rows if r.get("event") == "rollback"]
            res[name] = {
                "wall_s": time.perf_counter() - t0,
                "loss": [final[s] for s in range(1, SPIKE_STEPS + 1)],
                "last_eval_loss": summary["last_eval_loss"],
                "skipped_steps": summary["skipped_steps"], "rollbacks": summary["rollbacks"],
                "events": summary["spikes"],
                "steps_recomputed": sum(e["step"] - e["to_step"] for e in events),
                "restore_s": sum(e["restore_s"] for e in events),
                "data_position": summary["data_position"]}
            print(f"  {name}: last held-out loss {summary['last_eval_loss']:.4f}, skipped "
                  f"{summary['skipped_steps']}, rollbacks {summary['rollbacks']}", flush=True)
    finally:
        loop.make_batches = real
    return res


RESTART_STEPS, KILL_AFTER = 30, 10


def _launch_and_kill(out: Path, train: list[str], env: dict, *flags: str) -> dict:
    """One supervised launch whose process 1 is killed -9 once checkpoint KILL_AFTER exists."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    log = out.parent / (out.name + ".err")
    t0 = time.perf_counter()
    with open(log, "w") as err:
        p = subprocess.Popen([sys.executable, "-m", "jaxscale.cli", "launch", "--processes", "2",
                              "--max-restarts", "1", *flags, "--", *train, "--out", str(out)],
                             env=env, stdout=subprocess.DEVNULL, stderr=err)
        while not (out / "checkpoints" / str(KILL_AFTER)).is_dir():
            if p.poll() is not None:
                raise RuntimeError(log.read_text()[-3000:])
            time.sleep(0.01)
        pid = int(re.search(r"pids \d+ (\d+)", log.read_text()).group(1))
        os.kill(pid, signal.SIGKILL)
        t_kill = time.perf_counter()
        killed_at = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["step"]
        beat, first_pid, recovered = out / "heartbeat" / "process-0.json", None, None
        while p.poll() is None:
            try:
                hb = json.loads(beat.read_text())
            except (OSError, ValueError):
                hb = None
            if hb and first_pid is None:
                first_pid = hb["pid"]
            if hb and recovered is None and hb["pid"] != first_pid and hb.get("step", 0) > 0:
                recovered = time.perf_counter() - t_kill
            time.sleep(0.02)
    text = log.read_text()
    if p.returncode:
        raise RuntimeError(text[-3000:])
    resumed = int(re.search(r"resuming from checkpoint step (\d+)", text).group(1))
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {"wall_s": time.perf_counter() - t0, "recover_s": recovered,
            "resumed_from": resumed, "logged_before_kill": killed_at,
            "final_loss": rows[-1]["loss"], "steps": [r["step"] for r in rows],
            "mesh_note": next((ln for ln in text.splitlines() if "elastic" in ln.lower()), ""),
            "log_tail": text.splitlines()[-3:]}


def restarts(out: Path, small: list[str]) -> dict:
    """The uninterrupted run, then a kill restarted on the same processes and on one fewer."""
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(out / "jax_cache"),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0", PYTHONUNBUFFERED="1")
    env.pop("XLA_FLAGS", None)
    train = ["train", "llama_tiny", "--steps", str(RESTART_STEPS),
             *[a for x in small + ["ckpt.every=5", "mesh.dp=-1"] for a in ("--set", x)]]
    ref = out / "restarts" / "uninterrupted"
    shutil.rmtree(ref, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "jaxscale.cli", *train, "--out", str(ref)], env=env,
                   check=True, capture_output=True, timeout=600)
    want = json.loads((ref / "metrics.jsonl").read_text().splitlines()[-1])["loss"]
    res = {"uninterrupted_final_loss": want}
    for name, flags in (("same processes", ()), ("one process fewer", ("--elastic",))):
        r = _launch_and_kill(out / "restarts" / name.replace(" ", "_"), train, env, *flags)
        r["final_loss_rel_diff"] = abs(r["final_loss"] - want) / abs(want)
        res[name] = r
        print(f"  {name}: resumed from step {r['resumed_from']}, recovered in "
              f"{r['recover_s']:.1f} s, final loss {r['final_loss']:.6f} (uninterrupted "
              f"{want:.6f})", flush=True)
    return res


def pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_resume_time(ax, rows: list) -> None:
    s = [r["step"] for r in rows]
    ax.plot(s, [r["replay_s"] for r in rows], "o-", label="replay the stream to step S")
    ax.plot(s, [r["restore_s"] for r in rows], "s-", label="restore the saved data state")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("resume at step S (32 x 256 tokens per step)")
    ax.set_ylabel("seconds to the next batch")
    ax.set_title("Streamed data: resume time against step")
    ax.grid(alpha=0.3, which="both")
    ax.legend()


def plot_spikes(ax, res: dict) -> None:
    steps = np.arange(1, SPIKE_STEPS + 1)
    for name, r in res.items():
        ax.plot(steps, r["loss"], lw=2.5 if name == "clean" else 1.2,
                alpha=0.5 if name == "clean" else 1.0, label=name)
    ax.axvspan(BAD[0] + 0.5, BAD[-1] + 1.5, color="r", alpha=0.1,
               label=f"bad batches {BAD[0]}-{BAD[-1]}")
    ax.set_xlabel("step")
    ax.set_ylabel("train loss (the kept run after a rollback)")
    ax.set_title("Loss spikes: skipped and rolled back")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def restart_table(res: dict) -> str:
    lines = [f"| kill -9 of process 1 of 2 after checkpoint {KILL_AFTER} | resumed from step | "
             "steps recomputed | kill to first step (s) | whole run (s) | final loss | vs "
             "uninterrupted |", "|---|---|---|---|---|---|---|"]
    for name in ("same processes", "one process fewer"):
        r = res[name]
        lost = max(0, r["logged_before_kill"] - r["resumed_from"])
        lines.append(f"| restarted on {name} | {r['resumed_from']} | {lost} | "
                     f"{r['recover_s']:.1f} | {r['wall_s']:.0f} | {r['final_loss']:.6f} | "
                     f"{r['final_loss_rel_diff']:.1e} |")
    return "\n".join(lines)


def table(resume: list, spike: dict) -> str:
    lines = ["| resume at step | replay (s) | from the data state (s) | lengths read | state "
             "(bytes) | next batch equal |", "|---|---|---|---|---|---|"]
    for r in resume:
        lines.append(f"| {r['step']} | {r['replay_s']:.3f} | {r['restore_s']:.4f} | "
                     f"{r['lengths_read_on_restore']} | {r['state_bytes']} | "
                     f"{'yes' if r['equal'] else 'NO'} |")
    lines += ["", f"| bad batches {BAD[0]}-{BAD[-1]} | last held-out loss | skipped steps | "
              "rollbacks | steps recomputed | restore (s) | wall (s) |",
              "|---|---|---|---|---|---|---|"]
    for name, r in spike.items():
        lines.append(f"| {name} | {r['last_eval_loss']:.4f} | {r['skipped_steps']} | "
                     f"{r['rollbacks']} | {r['steps_recomputed']} | {r['restore_s']:.2f} | "
                     f"{r['wall_s']:.1f} |")
    return "\n".join(lines)
