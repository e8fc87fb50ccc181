"""python experiments/21_memory_profiling.py [--out runs/exp21] [--steps 8]

Topic 21: memory monitoring and profiling. `jaxscale.analysis.profiling.profile` (what `jaxscale
profile` runs) trains the tiny model (2 layers, dp=8, batch 8 x 32) for `--steps` steps twice:

- clean: the train loop as it should be (the donated state is replaced every step);
- leak: the same loop with a hook that keeps a derived copy of the embedding table every step,
  the classic leak of a Python list that holds device arrays (losses kept as arrays, debug
  copies, caches).

Each run writes a `jax.profiler` trace (`trace/`, with `perfetto_trace.json.gz` for
ui.perfetto.dev), a device-memory profile (`memory.prof`, pprof format) and a per-step table of
live arrays. The leak check flags live bytes that grow at every steady-state step; it should
flag the leak, at exactly the kept array's bytes (all shards) per step, and not the clean run.
Writes memory_timeline.png (both runs) next to each run's own files under --out.
"""
from __future__ import annotations

import time
from pathlib import Path

import _common as C  # first: it sets up the 8 simulated devices before jax is imported

import numpy as np  # noqa: E402

from jaxscale.analysis.profiling import format_table, profile  # noqa: E402


def main():
    args = C.parse_args(__doc__, "runs/exp21",
                        lambda ap: ap.add_argument("--steps", type=int, default=8))
    t0 = time.time()
    claims = C.Claims()
    out = Path(args.out)
    cfg = C.config(*C.DP8, steps=args.steps)
    clean = profile(cfg, steps=args.steps, out=out / "clean")
    kept, leaked_bytes = [], []

    def leak(step, state, metrics):
        x = state.params["embed"] * 1.0             # a new device array, kept forever
        kept.append(x)
        shard = int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize
        leaked_bytes.append(shard * len(x.sharding.device_set))
    leaky = profile(cfg, steps=args.steps, out=out / "leak", hook=leak)

    for name, r in (("clean", clean), ("leak", leaky)):
        print(f"\n{name} run ({r['out']}):")
        print(format_table(r))
    claims.check("clean run: no leak flagged", str(clean["leak"]), "None", clean["leak"] is None)
    found = leaky["leak"]["bytes_per_step"] if leaky["leak"] else 0.0
    claims.check("planted leak flagged, bytes per step = kept array (all shards)",
                 f"{found:,.0f}", f"{leaked_bytes[-1]:,}", found == leaked_bytes[-1])
    for name in ("clean", "leak"):
        d = out / name
        traces = list((d / "trace").rglob("*.xplane.pb"))
        perfetto = list((d / "trace").rglob("perfetto_trace.json.gz"))
        prof = d / "memory.prof"
        claims.check(f"{name}: trace (.xplane.pb, perfetto) and memory.prof written",
                     f"{len(traces)}, {len(perfetto)}, "
                     f"{prof.stat().st_size if prof.exists() else 0:,} B",
                     ">= 1, >= 1, > 0",
                     bool(traces) and bool(perfetto) and prof.exists() and prof.stat().st_size > 0)
    steady = [r["live_bytes"] for r in clean["rows"][2:]]
    claims.check("clean run: live bytes flat after warm-up (max - min)",
                 float(np.ptp(steady)), "0", np.ptp(steady) == 0)

    plt = C.pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for name, r, style in (("clean", clean, "o-"), ("planted leak", leaky, "s-")):
        ax.plot([x["step"] for x in r["rows"]], [x["live_bytes"] / C.MiB for x in r["rows"]],
                style, label=name)
    ax.axvspan(0.5, 2.5, color="0.9", label="warm-up")
    ax.set_xlabel("step")
    ax.set_ylabel("live array MiB (all devices)")
    ax.set_title(f"memory timeline: leak of {leaked_bytes[-1] / C.MiB:.2f} MiB/step flagged")
    ax.legend()
    ax.grid(alpha=0.3)
    C.save(fig, args.out, "memory_timeline.png")
    print(f"{time.time() - t0:.0f} s")
    claims.finish(args.out, {"clean": clean, "leak": leaky})


if __name__ == "__main__":
    main()
