"""One attempt of a launched run: start the processes, watch them, and stop them all on the first
failure or hang.

`run_group(...)` starts `processes` copies of the command (process 0's output straight through,
the others' prefixed `[process i]`), forwards SIGTERM/SIGINT to them, and polls every `POLL_S`:
- a process that exits non-zero (or is killed) makes the others be killed at once (SIGKILL: a
  collective with a dead peer can never finish, so there is nothing to save);
- a hang: a process whose heartbeat (`jaxscale.train.supervise`, in the run directory) shows no
  step within its limit, or that wrote no heartbeat within `STARTUP_FACTOR` x train.hang_min_s
  of the start. Every live process is asked for its Python stacks (a header line, then SIGUSR1
  appends them to `stacks/process-<i>.txt`), given up to `DUMP_WAIT_S` to write them, then
  killed; the status is `EXIT_RESTARTABLE`;
- a process still running `exit_grace` seconds after another exited cleanly is killed.
The `Outcome` says what happened, for the restart policy (`jaxscale.launch.restarts`).
"""
from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from jaxscale.launch.distributed import _child_env
from jaxscale.train import supervise

POLL_S = 0.1
HANG_CHECK_S = 0.5      # how often the heartbeat files are read
DUMP_WAIT_S = 5.0       # the longest wait for the stack dumps before the kill
EXIT_GRACE_S = 120      # after one process exits cleanly, how long the others get to follow


@dataclass
class Outcome:
    status: int                 # 0, or the exit status the launcher reports
    cause: str = ""             # what failed, in words
    lost: int | None = None     # the process that died (None: success, a hang, a straggler)
    signalled: bool = False     # the launcher was sent SIGTERM/SIGINT: never restarted


@dataclass
class Watch:
    """Where to find the heartbeats and the stack files, and the start-up limit."""
    out: Path | None = None     # the run directory; None: exits only, no hang detection
    hang_min_s: float = 300.0


def describe(code: int) -> str:
    """A process's end in words, from its Popen return code (-n: killed by signal n)."""
    if code in (-signal.SIGABRT, supervise.ABORT_STATUS):
        return ("was aborted (SIGABRT: JAX's coordination service ends a process this way when "
                "another one died)")
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    if code == supervise.EXIT_RESTARTABLE:
        return f"exited with status {code} (a hang or a lost peer: restartable)"
    return f"exited with status {code}"


def _blame(code: int) -> int:
    """Which failure caused the others, first: killed by a signal, then an error, then a
    process that only reports a peer's death (status 75, or aborted by JAX's coordination
    service)."""
    if code in (-signal.SIGABRT, supervise.ABORT_STATUS, supervise.EXIT_RESTARTABLE):
        return 2
    return 0 if code < 0 else 1


def _pump(stream, tag: str, sink) -> None:
    for line in iter(stream.readline, b""):
        sink.write(tag + line.decode(errors="replace"))
        sink.flush()


def _kill(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.wait()


def run_group(argv: list[str], processes: int, local_devices: int, port: int, heartbeat: int,
              prefix: str, watch: Watch, exit_grace: float = EXIT_GRACE_S, say=None,
              label: str = "") -> Outcome:
    """Run `argv` in `processes` processes until all exit, one fails, or they hang; `label` is
    the command as the log shows it."""
    say = say or (lambda msg: print(f"jaxscale launch: {msg}", file=sys.stderr, flush=True))
    procs, pumps, signalled = [], [], []
    for i in range(processes):
        extra = {supervise.SUPERVISOR_ENV: "launch"}
        if watch.out is not None:
            extra["JAXSCALE_STACK_FILE"] = str(supervise.stack_path(watch.out, i))
        env = _child_env(i, processes, port, local_devices, heartbeat, prefix, extra)
        p = subprocess.Popen(argv, env=env, start_new_session=True,
                             stdout=None if i == 0 else subprocess.PIPE,
                             stderr=None if i == 0 else subprocess.STDOUT)
        procs.append(p)
        if i:
            t = threading.Thread(target=_pump, args=(p.stdout, f"[process {i}] ", sys.stderr),
                                 daemon=True)
            t.start()
            pumps.append(t)
    say(f"{processes} {'processes' if processes > 1 else 'process'} x {local_devices} CPU "
        f"devices, coordinator 127.0.0.1:{port}, pids {' '.join(str(p.pid) for p in procs)}; "
        f"command: {label or shlex.join(argv)}")

    def forward(signum, frame):
        signalled.append(signum)
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signum)
                except ProcessLookupError:
                    pass
    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)} \
        if threading.current_thread() is threading.main_thread() else {}
    try:
        out = _watch(procs, exit_grace, watch, say)
        out.signalled = bool(signalled)
        return out
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        for p in procs:
            if p.poll() is None:
                _kill(p)
        for t in pumps:
            t.join(timeout=2)


def _watch(procs: list[subprocess.Popen], exit_grace: float, watch: Watch, say) -> Outcome:
    first_clean_exit, started, checked = None, time.time(), 0.0
    while True:
        codes = [p.poll() for p in procs]
        failed = sorted((_blame(c), i, c) for i, c in enumerate(codes) if c not in (None, 0))
        if failed:
            _, i, c = failed[0]
            alive = [p for p in procs if p.poll() is None]
            t0 = time.monotonic()
            for p in alive:
                _kill(p)
            cause = f"process {i} (pid {procs[i].pid}) {describe(c)}"
            say(f"error: {cause}; stopped the other {len(alive)} process(es) in "
                f"{time.monotonic() - t0:.1f} s")
            lost = None if _blame(c) == 2 else i
            return Outcome(c if c > 0 else 128 - c, cause, lost=lost)
        if all(c == 0 for c in codes):
            return Outcome(0)
        if any(c == 0 for c in codes):
            first_clean_exit = first_clean_exit or time.monotonic()
            if time.monotonic() - first_clean_exit > exit_grace:
                hung = [i for i, c in enumerate(codes) if c is None]
                for i in hung:
                    _kill(procs[i])
                cause = (f"process(es) {hung} still running {exit_grace:.0f} s after the others "
                         f"finished")
                say(f"error: {cause}; killed them")
                return Outcome(1, cause)
        if watch.out is not None and time.monotonic() - checked > HANG_CHECK_S:
            checked = time.monotonic()
            hang = find_hang(procs, watch, started)
            if hang:
                cause = f"a hang: {hang}"
                files = dump_stacks(procs, watch.out, cause)
                for p in procs:
                    if p.poll() is None:
                        _kill(p)
                where = (f"Python stacks of every process in {', '.join(map(str, files))}"
                         if files else "no process was left to dump its stacks")
                say(f"error: {cause}; {where}; stopped all {len(procs)} processes.")
                return Outcome(supervise.EXIT_RESTARTABLE, cause)
        time.sleep(POLL_S)


def find_hang(procs: list[subprocess.Popen], watch: Watch, started: float,
              now: float | None = None) -> str | None:
    """The hang in words, or None: the live process idle longest past its limit."""
    now = time.time() if now is None else now
    beats = supervise.read_heartbeats(watch.out)
    worst = None
    for i, p in enumerate(procs):
        if p.poll() is not None:
            continue
        hb = beats.get(i)
        if hb is not None and hb.get("pid") != p.pid:
            hb = None                           # an earlier attempt's
        if hb is None:
            idle, limit = now - started, supervise.STARTUP_FACTOR * watch.hang_min_s
            what = (f"process {i} wrote no heartbeat for {idle:.1f} s after it started "
                    f"(limit {limit:g} s: {supervise.STARTUP_FACTOR} x train.hang_min_s)")
        elif hb.get("closed"):
            continue
        else:
            idle, limit = now - hb["time"], hb["limit_s"]
            med = hb.get("median_s")
            basis = (f"max(train.hang_min_s, train.hang_factor x median step {med:.3g} s)"
                     if med is not None else "train.hang_min_s" if hb.get("started") else
                     f"{supervise.STARTUP_FACTOR} x train.hang_min_s before the first step")
            what = (f"process {i} completed no step for {idle:.1f} s after step {hb['step']} "
                    f"(limit {limit:.1f} s: {basis})")
        if idle > limit and (worst is None or idle - limit > worst[0]):
            worst = (idle - limit, what)
    return worst[1] if worst else None


def dump_stacks(procs: list[subprocess.Popen], out: Path, why: str) -> list[Path]:
    """Ask every live process for its Python stacks (SIGUSR1); the files they were written to."""
    files = {}
    for i, p in enumerate(procs):
        if p.poll() is not None:
            continue
        path = supervise.stack_path(out, i)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a") as f:
                f.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} process {i} (pid {p.pid}): "
                        f"jaxscale launch: {why} ===\n")
            files[path] = path.stat().st_size
            os.kill(p.pid, signal.SIGUSR1)
        except (OSError, ProcessLookupError):
            files.pop(path, None)
    deadline, stable, last = time.monotonic() + DUMP_WAIT_S, 0, None
    while files and time.monotonic() < deadline and stable < 2:
        time.sleep(POLL_S)           # until every file has grown and stopped growing
        sizes = {f: f.stat().st_size if f.exists() else 0 for f in files}
        done = sizes == last and all(sizes[f] > files[f] for f in files)
        stable, last = stable + 1 if done else 0, sizes
    return sorted(files)
