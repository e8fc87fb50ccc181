"""`jaxscale launch --async --workers N -- train ...`: one parameter server and N workers on this
machine, each a process of its own (`jaxscale.ps`).

The command's config is resolved once here (and written to `<out>/ps/config.json`, which the
processes read), so a bad command fails before any process starts. Each worker gets
`--local-devices` simulated CPU devices (on a GPU machine, set CUDA_VISIBLE_DEVICES per worker
in its environment instead). The supervisor polls every 0.1 s:
- a worker that exits non-zero or is killed is started again (up to `max_restarts` times per
  worker): it rejoins from the server's current parameters at its own data position;
- if the server dies, the workers are stopped and the supervisor exits with the server's status;
  the same command with `--resume` continues from the server's last checkpoint;
- when the server finishes (0), the workers have been told and leave; any still running after
  EXIT_GRACE_S are stopped.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from jaxscale.ps import ADDRESS_ENV, WORKER_ENV, WORKERS_ENV

POLL_S, EXIT_GRACE_S = 0.1, 60.0


def _env(extra: dict, local_devices: int) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1", **extra)
    flags = [f for f in env.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count="
                                         f"{local_devices}"])
    env.setdefault("JAX_PLATFORMS", "cpu")
    return env


def _say(msg: str) -> None:
    print(f"jaxscale launch --async: {msg}", file=sys.stderr, flush=True)


def _stop(p: subprocess.Popen) -> None:
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    p.wait()


def _check_port(port: int) -> None:
    import socket
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError as e:
            raise ValueError(f"--port {port} is not free on 127.0.0.1 ({e.strerror}): choose "
                             f"another, or 0 for a free one") from None


def run(cfg, out: Path, workers: int, port: int, resume: bool, local_devices: int = 1,
        max_restarts: int = 3) -> int:
    """Run the server and the workers to the end; the exit status."""
    from jaxscale import config as config_lib
    from jaxscale.launch import free_port
    if workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")
    if port:
        _check_port(port)
    out = Path(out)
    (out / "ps").mkdir(parents=True, exist_ok=True)
    cfg_path = out / "ps" / "config.json"
    config_lib.save(cfg, cfg_path)
    address = f"tcp://127.0.0.1:{port or free_port()}"
    common = {ADDRESS_ENV: address, WORKERS_ENV: str(workers)}
    py = [sys.executable, "-m"]
    server = subprocess.Popen(py + ["jaxscale.ps.server", str(cfg_path), str(out)]
                              + (["--resume"] if resume else []),
                              env=_env(common, 1), start_new_session=True)

    def start(w: int) -> subprocess.Popen:
        return subprocess.Popen(py + ["jaxscale.ps.worker", str(cfg_path)],
                                env=_env({**common, WORKER_ENV: str(w)}, local_devices),
                                start_new_session=True)
    procs = {w: start(w) for w in range(workers)}
    restarts, gone = {w: 0 for w in range(workers)}, set()
    _say(f"server pid {server.pid} on {address}; {workers} worker(s) x {local_devices} "
         f"device(s), pids {' '.join(str(p.pid) for p in procs.values())}")
    old = {s: signal.signal(s, lambda n, f: [os.killpg(p.pid, n) for p in
                                             [server, *procs.values()] if p.poll() is None])
           for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        while True:
            code = server.poll()
            if code is not None:
                if code != 0:
                    _say(f"error: the server exited with status {code}; stopping the workers. "
                         f"Its last checkpoint is intact: rerun the same command with --resume")
                    return code
                deadline = time.monotonic() + EXIT_GRACE_S
                while any(p.poll() is None for p in procs.values()) and \
                        time.monotonic() < deadline:
                    time.sleep(POLL_S)
                return 0
            for w, p in procs.items():
                c = p.poll()
                if c is None or c == 0:
                    continue
                if w in gone:
                    continue
                if restarts[w] >= max_restarts:
                    _say(f"error: worker {w} failed (status {c}) after {restarts[w]} "
                         f"restart(s); the others go on without it")
                    gone.add(w)
                    continue
                restarts[w] += 1
                procs[w] = start(w)
                _say(f"worker {w} exited with status {c}; restarted (restart {restarts[w]} of "
                     f"{max_restarts}), pid {procs[w].pid}: it rejoins from the server's "
                     f"current parameters")
            time.sleep(POLL_S)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        for p in [*procs.values(), server]:
            _stop(p)


def run_in_process(cfg, out: Path, workers: int, resume: bool = False, devices=None) -> dict:
    """The server and `workers` workers as threads of this process, worker w on device w (mod
    the devices), the server on the first: the same server, workers and ZeroMQ messages as `run`,
    for tests and quick studies (one Python process shares one GIL; `run`'s processes are what
    the mode is for). The server's summary, with each worker's applied pushes."""
    import threading

    import jax

    from jaxscale.launch import free_port
    from jaxscale.ps.server import Server
    from jaxscale.ps.worker import Worker
    devs = list(devices or jax.devices())
    address = f"tcp://127.0.0.1:{free_port()}"
    server = Server(cfg, Path(out), workers, address, resume, device=devs[0])
    pushes, errors = {}, []

    def work(w: int) -> None:
        try:
            pushes[w] = Worker(cfg, w, workers, address, [devs[w % len(devs)]]).run()
        except Exception as e:   # noqa: BLE001 - reported after the run
            errors.append(f"worker {w}: {type(e).__name__}: {e}")
    threads = [threading.Thread(target=work, args=(w,), daemon=True) for w in range(workers)]
    for t in threads:
        t.start()
    summary = server.serve()
    for t in threads:
        t.join(timeout=60)
    if errors:
        raise RuntimeError("; ".join(errors))
    summary["pushes_by_worker"] = {str(w): pushes.get(w) for w in range(workers)}
    return summary
