"""Experiment 13's runs of the real asynchronous mode (imported by `13_async_sgd.py`): the tiny
LLaMA trained through the parameter server (`jaxscale.ps`), its server and workers as threads of
the experiment's process (`supervisor.run_in_process`: the same server, workers and ZeroMQ
messages as `jaxscale launch --async`, whose processes the tests run), each worker on its own
simulated device.

- `slow_worker`: 4 workers, worker 3 made 2x and 4x slower; synchronous rounds (`ps.barrier`)
  against asynchronous pushes (staleness-aware step), loss against wall-clock time;
- `equal_workers`: 4 equal workers; the measured staleness histogram (against the simulator's);
- `divergence`: 8 workers, SGD at a step size synchronous training tolerates; the constant step
  against the staleness-aware one.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

WORKERS = 4
PUSHES = 48                     # batches of 8 x 32 tokens per run, every run


def _cache(out: Path) -> None:
    """One compilation cache for the runs: every worker compiles the same programs."""
    import jax
    jax.config.update("jax_compilation_cache_dir", str(out / "jax_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def _run(out: Path, config, *overrides, workers: int = WORKERS) -> dict:
    from jaxscale.ps.supervisor import run_in_process
    _cache(out.parent)
    shutil.rmtree(out, ignore_errors=True)
    barrier = "ps.barrier=true" in overrides
    steps = PUSHES // workers if barrier else PUSHES
    cfg = config(f"train.steps={steps}", "ckpt.every=0", "mesh.dp=1", "mesh.fsdp=1",
                 "mesh.tp=1", *overrides)
    summary = run_in_process(cfg, out, workers=workers)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    t0 = rows[0]["time_s"]          # from the first update: compilation left out
    summary["curve"] = [(r["time_s"] - t0, r["loss"]) for r in rows]
    summary["train_s"] = rows[-1]["time_s"] - t0
    summary["staleness"] = [r["staleness"] for r in rows]
    summary["by_worker"] = ([steps] * workers if barrier else      # every round: every worker
                            [sum(r["worker"] == w for r in rows) for w in range(workers)])
    return summary


def slow_worker(out: Path, config) -> dict:
    res = {}
    for factor in (2, 4):
        slow = f"ps.slow={WORKERS - 1}:{factor}"
        for name, extra in (("synchronous", ("ps.barrier=true",)),
                            ("asynchronous", ("ps.step_rule=staleness",))):
            key = f"{name}, worker {WORKERS - 1} {factor}x slower"
            res[key] = _run(out / f"slow{factor}_{name}", config, slow, *extra)
            r = res[key]
            print(f"  {key}: {r['train_s']:.1f} s for {PUSHES} batches, final loss "
                  f"{r['curve'][-1][1]:.3f}, pushes by worker {r['by_worker']}", flush=True)
    return res


def equal_workers(out: Path, config) -> dict:
    r = _run(out / "equal", config)
    print(f"  {WORKERS} equal workers: mean staleness {r['mean_staleness']:.2f}", flush=True)
    return r


def divergence(out: Path, config, lr: float = 1.0, workers: int = 8) -> dict:
    res = {}
    for rule in ("constant", "staleness"):
        r = _run(out / f"sgd_{rule}", config, "optim.kind=sgd", f"optim.lr={lr}",
                 "optim.warmup_steps=0", "optim.clip_norm=0", f"ps.step_rule={rule}",
                 workers=workers)
        r["max_loss"] = max(loss for _, loss in r["curve"])
        res[rule] = r
        print(f"  SGD lr {lr}, {workers} workers, {rule} step: largest loss {r['max_loss']:.3g}, "
              f"final {r['curve'][-1][1]:.3f}", flush=True)
    return res
