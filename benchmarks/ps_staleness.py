"""Staleness of the asynchronous parameter server with workers running at their own pace.

    python -m benchmarks.ps_staleness --out runs/ps_staleness

The tiny LLaMA through `jaxscale.ps`, with the workers as threads of one process
(`supervisor.run_in_process`: the same server, workers and ZeroMQ messages as the processes of
`jaxscale launch --async`), two cases:
- `equal`: N equal workers, each step stretched by `ps.slow` (a sleep, which releases the
  interpreter as separate processes would overlap); the mean staleness approaches N - 1;
- `slow`: 3 workers, worker 2 four times slower, `ps.step_rule=staleness`: the others do not
  wait for it, its pushes are staler and weighted 1 / (1 + staleness).
What the interleaving comes to depends on the machine and its load (measured on 2 loaded
cores: a mean of 2.4 to 2.6 for 4 equal workers; 1.5 to 2.2 without the sleeps): the tests drive
the server with a given order of pushes instead (`jaxscale.ps.scheduled`, `tests/test_ps.py`).
Writes `ps_staleness.json` and prints a table.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ASYNC = ("train.eval_every=0", "ckpt.async_save=false", "ckpt.every=0", "mesh.dp=1",
         "mesh.fsdp=1", "mesh.tp=1")


def case(name: str, workers: int, steps: int, *overrides: str) -> dict:
    from jaxscale.analysis.validation import tiny_config
    from jaxscale.ps.supervisor import run_in_process
    from jaxscale.train.metrics import read_metrics
    cfg = tiny_config(*ASYNC, f"train.steps={steps}", *overrides)
    with tempfile.TemporaryDirectory(prefix="jaxscale-ps-bench-") as d:
        summary = run_in_process(cfg, Path(d) / name, workers)
        rows = read_metrics(Path(d) / name / "metrics.jsonl")
    by = {w: [r["staleness"] for r in rows if r["worker"] == w] for w in range(workers)}
    return {"case": name, "workers": workers, "steps": steps, "overrides": list(overrides),
            "mean_staleness": summary["mean_staleness"],
            "histogram": summary["staleness_histogram"],
            "pushes": {str(w): len(s) for w, s in by.items()},
            "mean_by_worker": {str(w): sum(s) / len(s) if s else None for w, s in by.items()},
            "seconds": summary["seconds"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/ps_staleness")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=24)
    args = ap.parse_args(argv)
    from jaxscale.hardware import simulate_cpu_devices
    simulate_cpu_devices(8)                          # a device per worker
    n = args.workers
    rows = [case("equal", n, args.steps, "ps.slow=" + ",".join(f"{w}:6" for w in range(n))),
            case("slow", 3, args.steps, "ps.slow=2:4", "ps.step_rule=staleness")]
    print(f"{'case':6} {'workers':>7} {'mean staleness':>15}  pushes by worker / their mean "
          f"staleness")
    for r in rows:
        per = ", ".join(f"{w}: {k} / {r['mean_by_worker'][w]:.1f}" for w, k in r["pushes"].items()
                        if k)
        print(f"{r['case']:6} {r['workers']:7d} {r['mean_staleness']:15.2f}  {per}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ps_staleness.json").write_text(json.dumps({"rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
