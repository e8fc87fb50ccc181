"""Experiment 28: fault tolerance. Synchronous vs asynchronous checkpoint blocking time against
model size, and a kill -9 / resume run whose loss curve is the uninterrupted one.

Run (CPU, about six minutes):

    python experiments/28_fault_tolerance.py --out runs/exp28

Part 1 builds whole train states (parameters + AdamW moments + step, random values, sharded
dp2 x fsdp2 x tp2 over 8 simulated devices) of LLaMA-shaped models from ~1M to ~30M parameters
and saves each with an Orbax CheckpointManager, synchronous and asynchronous
(`jaxscale.train.checkpoint.Checkpointer`). "blocking" is how long the training loop waits in
`save()`; "commit" is the time until the checkpoint is finalized on disk. Async blocking is the
device -> host copy of the state only (here host memory to host memory; on a GPU, PCIe-bound); the
write runs on a background thread while training continues. One warm-up save per mode is not timed.

Part 2 trains llama_tiny (2 layers, seq 32, batch 8, 60 steps, checkpoint every 10) three ways
through the CLI: uninterrupted; killed with SIGKILL as soon as its step-30 checkpoint is committed
(the async write lets training run a few steps past it, so metrics.jsonl holds rows beyond the
checkpoint); and resumed with `--resume`. It prints both loss curves side by side with the bitwise
comparison, and plots them.

Part 3 (`_fault_recovery.resume_time`): a streamed, packed source of the stdlib's text resumed at
step S from the data state a checkpoint holds, against replaying the stream to S: flat against
growing, the next batch bitwise equal either way.

Part 4 (`_fault_recovery.spikes`): llama_tiny for 60 steps with batches 30-32's targets scrambled,
under `train.spike_policy` off, skip and rollback, beside the clean run: loss curves, steps lost,
the wall time of each recovery.

Part 5 (`_fault_recovery.restarts`): `jaxscale launch --processes 2 --max-restarts 1` (2 x 4
devices, 30 steps, a checkpoint every 5) with process 1 killed -9 after the step-10 checkpoint:
restarted on the same two processes, and with `--elastic` on one (4 devices, the planner's mesh);
steps lost, the wall time from the kill to the first step after it, the final loss against the
uninterrupted run's.

Writes results.json, table.md, save_blocking.png, resume.png and recovery.png to --out.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from _common import cpu_only  # first: 8 simulated devices before jax is imported

cpu_only()      # part 2's training subprocesses inherit JAX_PLATFORMS

import _fault_recovery as R  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxscale import config as config_lib  # noqa: E402
from jaxscale.train import checkpoint as ckpt_lib  # noqa: E402
from jaxscale.train import checkpoint_meta as ckpt_meta  # noqa: E402
from jaxscale.train import setup as setup_lib  # noqa: E402

MiB = 2 ** 20
SIZES = [(128, 2), (256, 4), (512, 4), (768, 4)]        # (model.dim, model.n_layers)
SMALL = ["model.n_layers=2", "data.seq_len=32", "data.batch_size=8", "data.max_bytes=400000",
         "train.eval_every=0", "optim.decay_steps=100"]


# ----------------------------------------------------------------------------- part 1
def random_state(dim: int, layers: int):
    cfg = config_lib.apply_overrides(config_lib.load_experiment("llama_tiny"), [
        f"model.dim={dim}", f"model.n_layers={layers}", f"model.ffn_dim={3 * dim}",
        "data.seq_len=32", "data.batch_size=8"])
    setup = setup_lib.build(cfg)
    rng = np.random.default_rng(0)

    def fill(a):
        x = (rng.standard_normal(a.shape, dtype=np.float32) if np.issubdtype(a.dtype, np.floating)
             else np.zeros(a.shape)).astype(a.dtype)
        return jax.device_put(x, a.sharding)
    state = jax.tree.map(fill, setup.abstract_state())
    jax.block_until_ready(state)
    n_params = sum(x.size for x in jax.tree.leaves(state.params))
    n_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
    return cfg, state, n_params, n_bytes


def time_saves(cfg, state, root: Path, repeats: int) -> dict:
    out = {}
    for mode in ("sync", "async"):
        ck = ckpt_lib.Checkpointer(root / mode, dataclasses.replace(
            cfg.ckpt, async_save=mode == "async", keep=1))
        blocking, commit = [], []
        for step in range(repeats + 1):
            meta = ckpt_meta.make_meta(cfg, state, step)
            t0 = time.perf_counter()
            ck.save(step, state, meta)
            b = ck.last_blocking_s
            ck.wait()
            if step:                                   # step 0 warms Orbax up
                blocking.append(b)
                commit.append(time.perf_counter() - t0)
        ck.close()
        out[mode] = {"blocking_s": float(np.median(blocking)), "commit_s": float(np.median(commit))}
    shutil.rmtree(root, ignore_errors=True)
    return out


def part1(out: Path, repeats: int) -> list[dict]:
    rows = []
    for dim, layers in SIZES:
        cfg, state, n_params, n_bytes = random_state(dim, layers)
        t = time_saves(cfg, state, out / "ckpt_timing", repeats)
        rows.append({"dim": dim, "layers": layers, "params_M": n_params / 1e6,
                     "state_MiB": n_bytes / MiB, **{f"{m}_{k}": v for m in t for k, v in
                                                   t[m].items()}})
        del state
        r = rows[-1]
        print(f"  dim {dim:4d} x {layers} layers: {r['params_M']:6.1f} M params, state "
              f"{r['state_MiB']:7.1f} MiB | sync blocks {r['sync_blocking_s']:.3f} s | async "
              f"blocks {r['async_blocking_s']:.3f} s, commits after {r['async_commit_s']:.3f} s",
              flush=True)
    return rows


# ----------------------------------------------------------------------------- part 2
def train_cmd(run: Path, steps: int, *extra: str) -> list[str]:
    sets = [a for s in SMALL + ["ckpt.every=10"] for a in ("--set", s)]
    return [sys.executable, "-m", "jaxscale.cli", "train", "llama_tiny", "--steps", str(steps),
            "--out", str(run), *sets, *extra]


def rows_of(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def part2(out: Path, steps: int = 60, kill_after: int = 30) -> dict:
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(out / "jax_cache"),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    env.pop("XLA_FLAGS", None)
    ref, run = out / "uninterrupted", out / "interrupted"
    for d in (ref, run):
        shutil.rmtree(d, ignore_errors=True)
    subprocess.run(train_cmd(ref, steps), env=env, check=True, capture_output=True, timeout=300)

    p = subprocess.Popen(train_cmd(run, steps), env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    while not (run / "checkpoints" / str(kill_after)).is_dir():
        if p.poll() is not None:
            raise RuntimeError(f"the run to be killed exited early ({p.returncode})")
        time.sleep(0.002)
    p.send_signal(signal.SIGKILL)
    p.wait()
    killed_at = max(r["step"] for r in rows_of(run))
    listing = ckpt_meta.scan(run / "checkpoints")
    r = subprocess.run(train_cmd(run, steps, "--resume"), env=env, capture_output=True,
                       text=True, timeout=300)
    if r.returncode:
        raise RuntimeError(r.stderr[-2000:])
    a, b = rows_of(ref), rows_of(run)
    equal = [x["loss"] == y["loss"] and x["grad_norm"] == y["grad_norm"] for x, y in zip(a, b)]
    return {"steps": steps, "killed_after_step": killed_at, "restored_step": listing.latest,
            "partial_at_kill": listing.partial, "bitwise_equal_steps": int(sum(equal)),
            "uninterrupted": [x["loss"] for x in a], "resumed": [x["loss"] for x in b],
            "rows_equal": equal}


# ----------------------------------------------------------------------------- report
def plots(out: Path, rows: list[dict], demo: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    mib = [r["state_MiB"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.plot(mib, [r["sync_blocking_s"] for r in rows], "o-", label="sync: blocking (= commit)")
    ax.plot(mib, [r["async_blocking_s"] for r in rows], "s-", label="async: blocking")
    ax.plot(mib, [r["async_commit_s"] for r in rows], "s--", alpha=0.6,
            label="async: commit (in background)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("train state size (MiB: params + AdamW moments)")
    ax.set_ylabel("seconds")
    ax.set_title("Checkpoint save: time the training loop waits (8 CPU devices)")
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "save_blocking.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    steps = np.arange(1, demo["steps"] + 1)
    ax.plot(steps, demo["uninterrupted"], lw=2.5, alpha=0.5, label="uninterrupted")
    ax.plot(steps, demo["resumed"], "k.", ms=4, label="killed -9, then --resume")
    ax.axvline(demo["killed_after_step"], color="r", ls=":",
               label=f"kill -9 (after step {demo['killed_after_step']})")
    ax.axvline(demo["restored_step"], color="g", ls="--",
               label=f"restored checkpoint (step {demo['restored_step']})")
    ax.set_xlabel("step")
    ax.set_ylabel("train loss")
    ax.set_title(f"Exact resume: {demo['bitwise_equal_steps']}/{demo['steps']} steps bitwise equal")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "resume.png", dpi=120)
    plt.close(fig)


def table(rows: list[dict], demo: dict) -> str:
    lines = ["| model dim x layers | params (M) | state (MiB) | sync blocking (s) | "
             "async blocking (s) | async commit (s) | sync / async blocking |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['dim']} x {r['layers']} | {r['params_M']:.1f} | "
                     f"{r['state_MiB']:.0f} | {r['sync_blocking_s']:.3f} | "
                     f"{r['async_blocking_s']:.3f} | {r['async_commit_s']:.3f} | "
                     f"{r['sync_blocking_s'] / r['async_blocking_s']:.1f}x |")
    lines += ["", f"kill -9 after step {demo['killed_after_step']}, restored step "
              f"{demo['restored_step']}: {demo['bitwise_equal_steps']}/{demo['steps']} steps "
              f"bitwise equal to the uninterrupted run", "",
              "| step | uninterrupted loss | killed + resumed loss | equal |", "|---|---|---|---|"]
    first = max(0, demo["restored_step"] - 3)
    for i in range(first, min(demo["steps"], demo["killed_after_step"] + 8)):
        mark = " <- restored from here" if i + 1 == demo["restored_step"] else (
            " <- killed here" if i + 1 == demo["killed_after_step"] else "")
        lines.append(f"| {i + 1} | {demo['uninterrupted'][i]:.6f} | {demo['resumed'][i]:.6f} | "
                     f"{'yes' if demo['rows_equal'][i] else 'NO'}{mark} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/exp28")
    ap.add_argument("--repeats", type=int, default=2, help="timed saves per size and mode")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # Orbax warns about time spent waiting for the previous save; here we wait on purpose.
    logging.getLogger("absl").setLevel(logging.ERROR)
    t0 = time.time()
    print("part 1: checkpoint save, sync vs async, against train state size", flush=True)
    rows = part1(out, args.repeats)
    print("part 2: kill -9 and resume vs an uninterrupted run (3 CLI runs)", flush=True)
    demo = part2(out)
    print("part 3: resume time against step, streamed data", flush=True)
    resume = R.resume_time(out)
    print("part 4: loss spikes under each policy (4 runs)", flush=True)
    spike = R.spikes(out, lambda *o: config_lib.apply_overrides(
        config_lib.load_experiment("llama_tiny"), SMALL + list(o)))
    print("part 5: a killed process, restarted on the same processes and on one fewer",
          flush=True)
    restart = R.restarts(out, SMALL)
    text = table(rows, demo) + "\n\n" + R.table(resume, spike) + "\n\n" + R.restart_table(
        restart)
    print(text)
    (out / "table.md").write_text(text + "\n")
    (out / "results.json").write_text(json.dumps({"saves": rows, "resume": demo,
                                                  "resume_time": resume, "spikes": spike,
                                                  "restarts": restart},
                                                 indent=2))
    plots(out, rows, demo)
    fig, axes = R.pyplot().subplots(1, 2, figsize=(12, 4.2))
    R.plot_resume_time(axes[0], resume)
    R.plot_spikes(axes[1], spike)
    fig.tight_layout()
    fig.savefig(out / "recovery.png", dpi=120)
    print(f"wrote {out}/table.md, results.json, save_blocking.png, resume.png, recovery.png "
          f"in {time.time() - t0:.0f} s")
    ok = (demo["bitwise_equal_steps"] == demo["steps"] and all(r["equal"] for r in resume)
          and spike["rollback"]["rollbacks"] >= 1 and spike["skip"]["skipped_steps"] >= 1
          and restart["same processes"]["final_loss_rel_diff"] < 1e-4
          and restart["one process fewer"]["final_loss_rel_diff"] < 1e-3)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
