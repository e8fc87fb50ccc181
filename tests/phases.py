"""Where the suite's time goes: each test's seconds in JAX tracing, lowering to MLIR and XLA
compiling (JAX's own monitoring events), its compilation-cache hits, and the rest (running the
programs, Python, subprocesses), one JSON line per test.

    JAXSCALE_TEST_PHASES=runs/phases.jsonl python -m pytest -q tests   # record (any -n)
    python -m tests.phases runs/phases.jsonl                             # summarise

`tests/conftest.py` registers the recorder when the variable is set (workers append to the one
file). The summary gives the phases' totals, the share of the slowest tests, the files by time
and the most compiled programs."""
from __future__ import annotations

import collections
import json
import os
import sys
import time

EVENTS = {"jaxpr_trace_duration": "trace", "jaxpr_to_mlir_module_duration": "lower",
          "backend_compile_duration": "compile"}


class Recorder:
    """A pytest plugin: one line per test to `path`, from the JAX events seen while it ran."""

    def __init__(self, path: str):
        from jax import monitoring
        self.path, self.start, self.acc = path, None, collections.Counter()
        self.programs: list = []
        monitoring.register_event_duration_secs_listener(self._duration)
        monitoring.register_event_listener(self._event)

    def _duration(self, event, duration, **kw):
        phase = EVENTS.get(event.rsplit("/", 1)[-1])
        if phase:
            self.acc[phase] += duration
            if phase == "compile":
                self.programs.append((kw.get("fun_name", "?"), round(duration, 3)))

    def close(self):
        from jax import monitoring
        monitoring.unregister_event_duration_listener(self._duration)
        monitoring.unregister_event_listener(self._event)

    def _event(self, event, **kw):
        if event.endswith("/cache_hits"):
            self.acc["cache_hits"] += 1

    def pytest_runtest_setup(self, item):
        self.start = time.perf_counter()

    def pytest_runtest_logfinish(self, nodeid, location):
        if self.start is None:
            return
        row = {"test": nodeid, "seconds": round(time.perf_counter() - self.start, 3),
               **{k: round(v, 3) for k, v in self.acc.items()}, "programs": self.programs}
        self.start, self.acc, self.programs = None, collections.Counter(), []
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")


def summary(rows: list[dict]) -> str:
    total = sum(r["seconds"] for r in rows) or 1.0
    out = [f"{len(rows)} tests, {total / 60:.1f} min of worker time"]
    phases = {p: sum(r.get(p, 0.0) for r in rows) for p in ("trace", "lower", "compile")}
    phases["run and the rest"] = total - sum(phases.values())
    out += [f"  {p:17s} {s / 60:7.1f} min  {s / total:5.1%}" for p, s in phases.items()]
    by_time = sorted((r["seconds"] for r in rows), reverse=True)
    out += [f"  the slowest {n:4d} tests: {sum(by_time[:n]) / total:5.1%} of it"
            for n in (10, 100) if n < len(rows)]
    files = collections.Counter()
    for r in rows:
        files[r["test"].split("::")[0]] += r["seconds"]
    out += ["files by time:"] + [f"  {s / 60:6.1f} min  {f}" for f, s in files.most_common(15)]
    programs = collections.Counter()
    counts = collections.Counter()
    for r in rows:
        for name, s in r.get("programs", ()):
            programs[name] += s
            counts[name] += 1
    out += ["programs by compile time:"] + [f"  {s / 60:6.1f} min  {counts[n]:5d} x  {n}"
                                            for n, s in programs.most_common(8)]
    return "\n".join(out)


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not os.path.exists(args[0]):
        print("usage: python -m tests.phases PHASES.jsonl (written by a run with "
              "JAXSCALE_TEST_PHASES=PHASES.jsonl)", file=sys.stderr)
        return 2
    with open(args[0]) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    print(summary(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
