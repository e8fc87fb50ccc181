"""`jaxscale profile`: a trace, a device-memory profile and a live-array leak check.

What it writes into the run directory:
- `trace/`: a `jax.profiler` trace of the steady-state steps (TensorBoard's profile plugin reads
  it; `perfetto_trace.json.gz` inside opens at ui.perfetto.dev);
- `memory.prof`: `jax.profiler.save_device_memory_profile` (pprof format: `pprof -http :8080`);
- `live_arrays.jsonl` and `memory_timeline.png`: after every step, the number and bytes of live
  arrays (`jax.live_arrays()`, summed over all shards), plus `device.memory_stats()` where the
  backend has them (GPU: bytes_in_use, peak_bytes_in_use).

Leak check: after the warm-up steps, a train loop holds a constant set of arrays (the donated
state is replaced, metrics are dropped). Live bytes that grow at every steady-state step are
flagged, with the shapes of the arrays that appeared.

XLA client allocator settings (environment, before the process starts):
- `XLA_PYTHON_CLIENT_PREALLOCATE=false`: allocate on demand instead of 75% of GPU memory at start
  (use when several processes share a GPU, or to see real usage in nvidia-smi);
- `XLA_PYTHON_CLIENT_MEM_FRACTION=0.9`: the preallocated fraction (raise it for the largest
  models; lower it to leave room for another framework, e.g. a PyTorch baseline);
- `XLA_PYTHON_CLIENT_ALLOCATOR=platform`: allocate and free exactly what is needed, no pool (slow;
  only for debugging fragmentation or leaks, since it makes memory usage exact).
"""
from __future__ import annotations

import gc
import json
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Callable

import jax


def live_arrays() -> tuple[int, int, Counter]:
    """(count, bytes over all shards, Counter of "shape:dtype") of the arrays alive now."""
    arrs = jax.live_arrays()
    total = 0
    kinds: Counter = Counter()
    for a in arrs:
        try:   # (reading shard.data would create per-device views that live on and count twice)
            total += a.on_device_size_in_bytes()
        except Exception:   # deleted (donated) between listing and reading
            continue
        kinds[f"{tuple(a.shape)}:{a.dtype}"] += 1
    return len(arrs), total, kinds


def find_leak(rows: list[dict], warmup: int) -> dict | None:
    """Live bytes growing at every step after `warmup`: a leak."""
    steady = [r for r in rows if r["step"] > warmup]
    if len(steady) < 3:
        return None
    growth = [b["live_bytes"] - a["live_bytes"] for a, b in zip(steady, steady[1:])]
    if all(g > 0 for g in growth):
        return {"bytes_per_step": sum(growth) / len(growth),
                "from_step": steady[0]["step"], "to_step": steady[-1]["step"]}
    return None


def profile(cfg, steps: int = 6, out: Path | None = None, warmup: int = 2,
            hook: Callable | None = None) -> dict:
    """Run `steps` train steps under the profiler; `hook(step, state, metrics)` runs after each."""
    from jaxscale.data import make_batches
    from jaxscale.train.setup import build

    out = Path(out or f"runs/{cfg.name}_profile")
    out.mkdir(parents=True, exist_ok=True)
    setup = build(cfg)
    batches, _ = make_batches(cfg.data)
    sh = setup.batch_shardings()
    state = setup.init_state()
    rows, seen = [], None
    tracing = False
    for step in range(1, steps + 1):
        if step == warmup + 1:
            jax.profiler.start_trace(str(out / "trace"), create_perfetto_trace=True)
            tracing = True
        with jax.profiler.StepTraceAnnotation("train", step_num=step):
            state, metrics = setup.train_step(state, setup.train_batch(
                batches.device_batch(step - 1, sh)))
            jax.block_until_ready(state)
        if hook is not None:
            hook(step, state, metrics)
        del metrics
        gc.collect()
        n, b, kinds = live_arrays()
        new = sorted((kinds - seen).elements()) if seen is not None else []
        seen = kinds
        row = {"step": step, "live_arrays": n, "live_bytes": b, "new_arrays": new[:8]}
        stats = jax.devices()[0].memory_stats()
        if stats:
            row.update({k: stats[k] for k in ("bytes_in_use", "peak_bytes_in_use") if k in stats})
        rows.append(row)
    if tracing:
        jax.profiler.stop_trace()
    jax.profiler.save_device_memory_profile(str(out / "memory.prof"))
    with open(out / "live_arrays.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    leak = find_leak(rows, warmup)
    _plot(rows, out / "memory_timeline.png", leak)
    return {"rows": rows, "leak": leak, "out": str(out)}


def format_table(result: dict) -> str:
    lines = [f"{'step':>5}{'live arrays':>13}{'live MiB':>12}  new arrays"]
    for r in result["rows"]:
        lines.append(f"{r['step']:>5}{r['live_arrays']:>13}{r['live_bytes'] / 2**20:>12.3f}  "
                     f"{', '.join(r['new_arrays'][:3])}")
    leak = result["leak"]
    lines.append("LEAK: live bytes grow by %.0f bytes/step from step %d to %d" % (
        leak["bytes_per_step"], leak["from_step"], leak["to_step"]) if leak else
        "no leak: live bytes are flat in the steady state")
    return "\n".join(lines)


def _plot(rows, path: Path, leak) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r["step"] for r in rows], [r["live_bytes"] / 2**20 for r in rows], "o-")
    ax.set_xlabel("step")
    ax.set_ylabel("live array MiB (all devices)")
    ax.set_title("memory timeline" + (" - LEAK" if leak else ""))
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def median_seconds(fn, *args, reps: int = 5) -> float:
    """Median wall seconds of `fn(*args)` over `reps` calls after one warm-up call (which also
    compiles), each waited for (`jax.block_until_ready`)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ----------------------------------------------------------------------------- host RAM
def host_status(key: str) -> int:
    """A /proc/self/status field of this process in bytes (`VmRSS`: resident now, `VmHWM`: its
    peak since the last `reset_host_peak`)."""
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def reset_host_peak() -> bool:
    """Return freed heap to the system (glibc's `malloc_trim`: what compiling left behind), then
    reset VmHWM to the current RSS (Linux >= 4.0: `echo 5 > /proc/self/clear_refs`); False where
    the peak cannot be reset."""
    import ctypes
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False
