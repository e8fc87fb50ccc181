"""Multi-process runs: `jax.distributed` initialisation and a one-machine launcher with a watchdog.

    jaxscale launch --processes 2 -- train llama_tiny --steps 50 --out runs/mp

starts 2 processes of `jaxscale train ...`, each with 4 simulated CPU devices (8 in all), CPU
collectives over gloo, process 0 hosting the coordinator on 127.0.0.1. Every process runs the
same program on its own devices; XLA inserts the cross-process collectives, so the loss equals
the one-process 8-device run's. Checkpoints are written by all processes (each its own shards)
into the same directory, which must be shared (it is, on one machine).

Initialisation, in `initialize_from_env()` (called by `jaxscale train` before JAX starts):
- `JAXSCALE_COORDINATOR=host:port`, `JAXSCALE_NUM_PROCESSES`, `JAXSCALE_PROCESS_ID`: explicit, as
  the launcher sets them, or by hand / from any scheduler on a cluster;
- otherwise under SLURM with more than one task (`SLURM_NTASKS` > 1): `jax.distributed.initialize()`
  reads the coordinator, process count and id from SLURM's environment (`srun jaxscale train ...`);
- otherwise a single process: nothing to do.

Failure of one process, and how long the others take to notice (the stated bound):
- under this launcher the watchdog polls its children every 0.1 s; when one exits non-zero (or
  is killed) it kills the rest at once (SIGKILL: a collective with a dead peer can never finish,
  so there is nothing to save) and exits with that status: under a second in practice;
- without the launcher (SLURM, by hand): a process blocked in a collective with a dead peer gets a
  gloo "connection closed" error at once and exits non-zero; otherwise the coordination service
  misses the dead process's heartbeats and terminates every process after
  `JAXSCALE_HEARTBEAT_TIMEOUT` seconds (default 30; JAX's own default is 100).
Finalized checkpoints survive all of this: an interrupted save is only ever a tmp directory.

Signals: SIGTERM/SIGINT to the launcher are forwarded to every process (each in its own session,
so a terminal's Ctrl-C reaches them once, through the launcher); the processes agree on a step,
save it and exit 0. A second signal is forwarded too and makes them exit at once.
"""
from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time

HEARTBEAT_TIMEOUT_S = 30
POLL_S = 0.1
EXIT_GRACE_S = 120      # after one process exits cleanly, how long the others get to follow


def initialize_from_env(env=None) -> bool:
    """Join a multi-process JAX job described by the environment; False for a single process."""
    env = os.environ if env is None else env
    heartbeat = int(env.get("JAXSCALE_HEARTBEAT_TIMEOUT", HEARTBEAT_TIMEOUT_S))
    coordinator = env.get("JAXSCALE_COORDINATOR")
    slurm = "SLURM_JOB_ID" in env and int(env.get("SLURM_NTASKS", "1")) > 1
    if not coordinator and not slurm:
        return False
    import jax
    # CPU collectives across processes go over gloo (TCP); GPU ones use NCCL regardless.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if coordinator:
        try:
            n, i = int(env["JAXSCALE_NUM_PROCESSES"]), int(env["JAXSCALE_PROCESS_ID"])
        except (KeyError, ValueError):
            raise ValueError("JAXSCALE_COORDINATOR is set, so JAXSCALE_NUM_PROCESSES and "
                             "JAXSCALE_PROCESS_ID must be integers too") from None
        jax.distributed.initialize(coordinator, num_processes=n, process_id=i,
                                   heartbeat_timeout_seconds=heartbeat,
                                   initialization_timeout=int(env.get("JAXSCALE_INIT_TIMEOUT",
                                                                      120)))
    else:
        jax.distributed.initialize(heartbeat_timeout_seconds=heartbeat)
    return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child_env(i: int, n: int, port: int, local_devices: int, heartbeat: int,
               prefix: str) -> dict:
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={local_devices}"])
    env.update(JAXSCALE_COORDINATOR=f"127.0.0.1:{port}", JAXSCALE_NUM_PROCESSES=str(n),
               JAXSCALE_PROCESS_ID=str(i), JAXSCALE_HEARTBEAT_TIMEOUT=str(heartbeat),
               JAXSCALE_LAUNCH_PREFIX=prefix, PYTHONUNBUFFERED="1")
    env.setdefault("JAX_PLATFORMS", "cpu")
    return env


def _pump(stream, tag: str, sink) -> None:
    for line in iter(stream.readline, b""):
        sink.write(tag + line.decode(errors="replace"))
        sink.flush()


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def launch(command: list[str], processes: int = 2, local_devices: int = 4, port: int = 0,
           heartbeat: int = HEARTBEAT_TIMEOUT_S, exit_grace: float = EXIT_GRACE_S) -> int:
    """Run `jaxscale <command>` in `processes` local processes; the first failure stops them all."""
    if processes < 1:
        raise ValueError(f"--processes must be >= 1, got {processes}")
    if not command or command[0] != "train":
        raise ValueError("give the command to run after --, e.g. "
                         "`jaxscale launch --processes 2 -- train llama_tiny --steps 20`")
    port = port or free_port()
    prefix = f"jaxscale launch --processes {processes} --local-devices {local_devices} --"
    argv = [sys.executable, "-m", "jaxscale.cli", *command]
    procs, pumps = [], []
    for i in range(processes):
        env = _child_env(i, processes, port, local_devices, heartbeat, prefix)
        p = subprocess.Popen(argv, env=env, start_new_session=True,
                             stdout=None if i == 0 else subprocess.PIPE,
                             stderr=None if i == 0 else subprocess.STDOUT)
        procs.append(p)
        if i:
            t = threading.Thread(target=_pump, args=(p.stdout, f"[process {i}] ", sys.stderr),
                                 daemon=True)
            t.start()
            pumps.append(t)
    print(f"jaxscale launch: {processes} processes x {local_devices} CPU devices, coordinator "
          f"127.0.0.1:{port}, pids {' '.join(str(p.pid) for p in procs)}; command: "
          f"{shlex.join(command)}", file=sys.stderr, flush=True)

    def forward(signum, frame):
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signum)
                except ProcessLookupError:
                    pass
    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)} \
        if threading.current_thread() is threading.main_thread() else {}
    try:
        return _watch(procs, exit_grace)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        for p in procs:
            if p.poll() is None:
                _kill(p)
        for t in pumps:
            t.join(timeout=2)


def _kill(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.wait()


def _watch(procs: list[subprocess.Popen], exit_grace: float) -> int:
    first_clean_exit = None
    while True:
        codes = [p.poll() for p in procs]
        failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            i, c = failed[0]
            alive = [p for p in procs if p.poll() is None]
            t0 = time.monotonic()
            for p in alive:
                _kill(p)
            print(f"jaxscale launch: error: process {i} (pid {procs[i].pid}) {_describe(c)}; "
                  f"stopped the other {len(alive)} process(es) in {time.monotonic() - t0:.1f} s. "
                  f"Finalized checkpoints are intact: rerun the same command with --resume.",
                  file=sys.stderr, flush=True)
            return c if c > 0 else 128 - c
        if all(c == 0 for c in codes):
            return 0
        if any(c == 0 for c in codes):
            first_clean_exit = first_clean_exit or time.monotonic()
            if time.monotonic() - first_clean_exit > exit_grace:
                hung = [i for i, c in enumerate(codes) if c is None]
                for i in hung:
                    _kill(procs[i])
                print(f"jaxscale launch: error: process(es) {hung} still running "
                      f"{exit_grace:.0f} s after the others finished; killed them",
                      file=sys.stderr, flush=True)
                return 1
        time.sleep(POLL_S)
