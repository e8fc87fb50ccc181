"""The planner's prediction in wall time, for every published run it is validated against.

    python -m benchmarks.planner_speed --out runs/planner_speed

Each run of `validation.PUBLISHED` (Llama 3 405B on 16,384 H100 among them) is predicted
(`planner.predict`: memory, collectives, FLOPs, step time, from formulas alone) `--reps` times
after one warm-up; the median wall time and the Python function calls of one prediction are
printed beside the device count. The calls are the machine-independent figure (the test
`test_planner_published.py` holds them to the device count's independence); the times are the
machine's. Writes `planner_speed.json`.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


def calls(fn) -> int:
    """Python and builtin function calls made by `fn()`."""
    n = [0]

    def count(frame, event, arg):
        n[0] += event in ("call", "c_call")
    sys.setprofile(count)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return n[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/planner_speed")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    from jaxscale import planner
    from jaxscale.analysis import validation
    rows = []
    for run in validation.PUBLISHED:
        cfg = validation.published_config(run)
        pred = planner.predict(cfg)                  # warm-up: lazy imports, caches
        times = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            planner.predict(cfg)
            times.append(time.perf_counter() - t0)
        rows.append({"run": run.name, "devices": pred.spec.n_devices,
                     "median_s": statistics.median(times), "max_s": max(times),
                     "calls": calls(lambda cfg=cfg: planner.predict(cfg))})
    print(f"{'run':44} {'devices':>8} {'median ms':>10} {'max ms':>8} {'calls':>8}")
    for r in rows:
        print(f"{r['run'][:44]:44} {r['devices']:8d} {1e3 * r['median_s']:10.1f} "
              f"{1e3 * r['max_s']:8.1f} {r['calls']:8d}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "planner_speed.json").write_text(json.dumps({"reps": args.reps, "rows": rows},
                                                       indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
