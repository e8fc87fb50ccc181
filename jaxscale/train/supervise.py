"""Supervision inside a training process: heartbeat files, a hang watchdog, Python stack dumps
on demand, and the straggler report.

`Monitor(cfg.train, out, start_step)` is made by every process of a run; `stepped(step, seconds)`
is called by every process after every step; `close()` (or leaving the `with` block) stops it.

Files, in the run directory `out`:
- `heartbeat/process-<i>.json`: this process's pid, last completed step, the wall-clock time it
  completed, the median step time and the hang limit in force (rewritten atomically by the
  watchdog thread within a second of a step); `jaxscale launch` reads them to find hangs;
- `stacks/process-<i>.txt`: every thread's Python stack, appended on SIGUSR1 (faulthandler, so
  it works while the main thread is blocked inside XLA) and by the watchdog before it exits.

The hang limit (`hang_limit`): no step within max(train.hang_min_s, train.hang_factor x the
median step time over the last `WINDOW` steps). Until a median exists it is train.hang_min_s,
and `STARTUP_FACTOR` x train.hang_min_s before the first step completes (compilation). The
limit runs from the last completed step, so evaluation and checkpoint saves between steps fall
under it (the hang_min_s floor is there for them).

The watchdog (a daemon thread): when the limit passes without a step, it dumps the stacks, says
so on stderr and exits the process with `EXIT_RESTARTABLE` (75, EX_TEMPFAIL): a scheduler
(SLURM `--requeue`, a Kubernetes restart policy, a torchrun-style agent) that retries on it runs
the same command with `--resume`. Under `jaxscale launch` (environment `JAXSCALE_SUPERVISOR=
launch`) the launcher owns hangs: it reads the heartbeats, dumps every process's stacks at once
and restarts them all; the thread then only writes heartbeats.

A lost peer: a process blocked in a collective whose peer died gets a gloo (or NCCL) error at
once; leaving the `with Monitor(...)` block with such an error (`peer_lost`) exits with
`EXIT_RESTARTABLE` at once, skipping JAX's exit-time shutdown barrier, which would wait for the
dead peer until the heartbeat timeout and then abort (status 134). A process that is not in a
collective when the peer dies is terminated by JAX's coordination service after the heartbeat
timeout, from C++: status 134 (`ABORT_STATUS`, 128 + SIGABRT), which Python cannot change;
treat 134 as restartable too.

A checkpoint that cannot be written (a full or read-only checkpoint directory: a
`RestartableError`) likewise exits with `EXIT_RESTARTABLE` at once when it leaves the `with
Monitor(...)` block, its message naming the directory, the cause and the last intact checkpoint:
the interpreter's exit would otherwise wait for the checkpoint writer's background threads, some
of them blocked for minutes on signals from the writes that failed.

Straggler report: every `train.straggler_every` steps (0: never; one process: nothing to
compare) each process's mean step time over the steps since the last report (the first step,
compilation, left out) is gathered with `multihost_utils.process_allgather`; a process slower
than `train.straggler_factor` x the median (the lower middle value for an even count, so that of
two processes the slower is compared with the faster) is named on stderr by process 0 and in the
metrics row: `step_time_by_process` (a list, by process id) and `straggler` ({process id: mean
seconds}). In a synchronous step the collectives make every process wait for the slowest, so
whole-step times even out: the report tells the most about work a process does on its own.
"""
from __future__ import annotations

import faulthandler
import json
import os
import re
import signal
import statistics
import sys
import threading
import time
from collections import deque
from pathlib import Path

EXIT_RESTARTABLE = 75          # EX_TEMPFAIL: a hang or a lost peer; rerun with --resume
EXIT_STOPPED = 3               # stopped on purpose (train.nonfinite=stop, train.max_rollbacks):
                               # a rerun would meet the same batch, so nothing restarts it
ABORT_STATUS = 128 + signal.SIGABRT     # JAX's coordination service terminating a process
STARTUP_FACTOR = 2             # before the first step completes: this x train.hang_min_s
WINDOW = 100                   # step times the median is taken over
SUPERVISOR_ENV = "JAXSCALE_SUPERVISOR"   # "launch": the launcher decides about hangs
#: error texts of a collective whose peer is gone (gloo on CPU, NCCL on GPU) or of the
#: coordination service reporting a dead task
PEER_LOST = re.compile(r"Gloo .*(Connection (reset|closed|refused)|Broken pipe|Socket closed)"
                       r"|NCCL .*(remote process exited|unhandled system error)"
                       r"|heartbeat timeout|tasks are unhealthy|Barrier failed", re.S | re.I)

_stack_files: dict[int, object] = {}    # signal -> open file faulthandler writes into


class RestartableError(RuntimeError):
    """A failure a rerun with --resume can get past once its cause is fixed (a checkpoint that
    could not be written: `checkpoint_meta.CheckpointWriteError`); its message names what is
    kept. Leaving the `with Monitor(...)` block with one exits with `EXIT_RESTARTABLE` at once."""


def heartbeat_path(out: Path, process: int) -> Path:
    return Path(out) / "heartbeat" / f"process-{process}.json"


def stack_path(out: Path, process: int) -> Path:
    return Path(out) / "stacks" / f"process-{process}.txt"


def register_stack_dump(path: Path) -> None:
    """Append every thread's Python stack to `path` on SIGUSR1 (replacing an earlier target)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    f = open(path, "a")
    faulthandler.register(signal.SIGUSR1, file=f, all_threads=True, chain=False)
    old = _stack_files.pop(signal.SIGUSR1, None)
    _stack_files[signal.SIGUSR1] = f
    if old is not None:
        old.close()


def hang_limit(median: float | None, started: bool, hang_factor: float,
               hang_min_s: float) -> float:
    """Seconds without a step that count as a hang (see the module docstring)."""
    if not started:
        return STARTUP_FACTOR * hang_min_s
    if median is None:
        return hang_min_s
    return max(hang_min_s, hang_factor * median)


def read_heartbeats(out: Path) -> dict[int, dict]:
    """The heartbeat of every process that wrote one: {process id: heartbeat}."""
    found = {}
    for p in sorted((Path(out) / "heartbeat").glob("process-*.json")):
        try:
            hb = json.loads(p.read_text())
            found[int(hb["process"])] = hb
        except (OSError, ValueError, KeyError, TypeError):
            continue                    # being replaced, or not ours
    return found


def peer_lost(exc: BaseException | None) -> bool:
    """Whether an error is a collective or the coordination service reporting a dead peer."""
    return exc is not None and bool(PEER_LOST.search(str(exc)))


def straggler_report(means: list[float], factor: float) -> dict:
    """The metrics of one gathering: every process's mean step time and the slow ones."""
    med = statistics.median_low(means)
    row = {"step_time_by_process": [round(float(t), 6) for t in means]}
    slow = {str(i): round(float(t), 6) for i, t in enumerate(means) if t > factor * med}
    if slow:
        row["straggler"] = slow
    return row


def _allgather(x: float):
    import numpy as np
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(np.float32(x))).reshape(-1)


class Monitor:
    """One training process's heartbeat, watchdog, stack dumps and straggler report.

    `process`/`processes` default to JAX's; `gather` (a float -> every process's float) to
    `process_allgather`; `supervisor` to the environment's `JAXSCALE_SUPERVISOR`."""

    def __init__(self, train_cfg, out: Path, start_step: int, *, process: int | None = None,
                 processes: int | None = None, gather=None, supervisor: str | None = None):
        if process is None or processes is None:
            import jax
            process, processes = jax.process_index(), jax.process_count()
        self.cfg, self.out, self.process, self.processes = train_cfg, Path(out), process, processes
        self.stack_file = stack_path(self.out, process)
        self._gather = gather or _allgather
        self._owner = supervisor if supervisor is not None else os.environ.get(SUPERVISOR_ENV, "")
        self._times: deque[float] = deque(maxlen=WINDOW)
        self._since_report: list[float] = []
        self._lock = threading.Lock()
        self._step, self._last, self._started = start_step, time.time(), False
        self._written = None
        self._stop = threading.Event()
        register_stack_dump(self.stack_file)
        heartbeat_path(self.out, process).parent.mkdir(parents=True, exist_ok=True)
        self._heartbeat()
        poll = min(1.0, max(0.01, train_cfg.hang_min_s / 20))
        self._thread = threading.Thread(target=self._watch, args=(poll,), daemon=True,
                                        name=f"jaxscale-watchdog-{process}")
        self._thread.start()

    # ------------------------------------------------------------------ the training side
    def stepped(self, step: int, seconds: float) -> dict:
        """Step `step` (steps completed) took `seconds` here; extra metrics for its row."""
        with self._lock:
            self._step, self._last = step, time.time()
            if self._started:               # the first step compiles: not a step time
                self._times.append(float(seconds))
                self._since_report.append(float(seconds))
            self._started = True
        every = self.cfg.straggler_every
        if not every or self.processes < 2 or step % every:
            return {}
        return self._report(step)

    def close(self) -> None:
        """Stop the watchdog; the heartbeat says the process is done. SIGUSR1 still dumps the
        stacks (the rest of the process, its final save and summary, can hang too)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=5)
        self._heartbeat(closed=True)

    def __enter__(self) -> "Monitor":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()
        if isinstance(exc, RestartableError):
            who = f"process {self.process}: " if self.processes > 1 else ""
            print(f"jaxscale train: error: {who}{exc}\njaxscale train: exiting with status "
                  f"{EXIT_RESTARTABLE} (restartable)", file=sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(EXIT_RESTARTABLE)   # background writer threads must not hold the exit
        if peer_lost(exc):
            first = str(exc).strip().splitlines()[0][:300]
            print(f"jaxscale train: error: process {self.process} lost a peer ({first}); "
                  f"exiting with status {EXIT_RESTARTABLE} (restartable): rerun the same "
                  f"command with --resume", file=sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(EXIT_RESTARTABLE)      # JAX's exit-time barrier would wait, then abort

    # ------------------------------------------------------------------ internals
    def median(self) -> float | None:
        with self._lock:
            return statistics.median(self._times) if self._times else None

    def limit(self) -> float:
        return hang_limit(self.median(), self._started, self.cfg.hang_factor,
                          self.cfg.hang_min_s)

    def _report(self, step: int) -> dict:
        with self._lock:
            window, self._since_report = self._since_report, []
        if not window:      # only the compiling step since the start: the same on every process
            return {}
        means = [float(x) for x in self._gather(statistics.fmean(window))]
        row = straggler_report(means, self.cfg.straggler_factor)
        if "straggler" in row and self.process == 0:
            med = statistics.median_low(means)
            names = ", ".join(f"process {i} {t:.3g} s ({t / med:.1f}x)"
                              for i, t in row["straggler"].items())
            print(f"jaxscale train: straggler at step {step}: {names} against the median "
                  f"{med:.3g} s, mean step times over the last {len(window)} steps "
                  f"(train.straggler_factor={self.cfg.straggler_factor})",
                  file=sys.stderr, flush=True)
        return row

    def _heartbeat(self, closed: bool = False) -> None:
        with self._lock:
            state = (self._step, self._last, self._started, closed)
        if state == self._written:
            return
        med = self.median()
        hb = {"process": self.process, "pid": os.getpid(), "step": state[0], "time": state[1],
              "started": state[2], "median_s": med, "limit_s": self.limit(), "closed": closed}
        path = heartbeat_path(self.out, self.process)
        tmp = path.with_suffix(".json.tmp")
        try:
            tmp.write_text(json.dumps(hb) + "\n")
            os.replace(tmp, path)
            self._written = state
        except OSError as e:      # a full disk must not stop training; say it once
            if self._written != "failed":
                print(f"jaxscale train: warning: cannot write {path}: {e}", file=sys.stderr)
                self._written = "failed"

    def _watch(self, poll: float) -> None:
        while not self._stop.wait(poll):
            self._heartbeat()
            with self._lock:
                step, last = self._step, self._last
            idle, limit = time.time() - last, self.limit()
            if idle > limit and self._owner != "launch":
                self._expire(step, idle, limit)

    def _expire(self, step: int, idle: float, limit: float) -> None:
        what = (f"no step completed for {idle:.1f} s after step {step} (limit {limit:.1f} s: "
                f"max(train.hang_min_s={self.cfg.hang_min_s:g}, train.hang_factor="
                f"{self.cfg.hang_factor:g} x median step time))")
        try:
            with open(self.stack_file, "a") as f:
                f.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} process {self.process} "
                        f"(pid {os.getpid()}): watchdog: {what} ===\n")
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
        except OSError:
            pass
        print(f"jaxscale train: error: process {self.process}: {what}; Python stacks in "
              f"{self.stack_file}; exiting with status {EXIT_RESTARTABLE} (restartable): "
              f"rerun the same command with --resume", file=sys.stderr, flush=True)
        os._exit(EXIT_RESTARTABLE)
