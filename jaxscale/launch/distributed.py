"""Joining a multi-process JAX job, and the environment `jaxscale launch` gives its processes.

`initialize_from_env()` (called by `jaxscale train` before JAX starts):
- `JAXSCALE_COORDINATOR=host:port`, `JAXSCALE_NUM_PROCESSES`, `JAXSCALE_PROCESS_ID`: explicit, as
  the launcher sets them, or by hand / from any scheduler on a cluster;
- otherwise under SLURM with more than one task (`SLURM_NTASKS` > 1): `jax.distributed.initialize()`
  reads the coordinator, process count and id from SLURM's environment (`srun jaxscale train ...`);
- otherwise a single process: nothing to do.
With `JAXSCALE_STACK_FILE` set (the launcher sets it) SIGUSR1 appends every thread's Python stack
to that file from the start, so a process that hangs before its first step can be asked too.

A process that misses the coordination service's heartbeats for `JAXSCALE_HEARTBEAT_TIMEOUT`
seconds (default 30; JAX's own default is 100) is declared dead and every process is terminated.
"""
from __future__ import annotations

import os
import socket

HEARTBEAT_TIMEOUT_S = 30


def initialize_from_env(env=None) -> bool:
    """Join a multi-process JAX job described by the environment; False for a single process."""
    env = os.environ if env is None else env
    if env.get("JAXSCALE_STACK_FILE"):
        from jaxscale.train.supervise import register_stack_dump
        register_stack_dump(env["JAXSCALE_STACK_FILE"])
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
    """A TCP port on 127.0.0.1 that is free now (for the coordinator)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child_env(i: int, n: int, port: int, local_devices: int, heartbeat: int,
               prefix: str, extra: dict | None = None) -> dict:
    """Process `i` of `n`'s environment: its simulated devices, the coordinator, the heartbeat
    timeout, the command that resumes the run (`prefix`) and `extra` variables."""
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={local_devices}"])
    env.update(JAXSCALE_COORDINATOR=f"127.0.0.1:{port}", JAXSCALE_NUM_PROCESSES=str(n),
               JAXSCALE_PROCESS_ID=str(i), JAXSCALE_HEARTBEAT_TIMEOUT=str(heartbeat),
               JAXSCALE_LAUNCH_PREFIX=prefix, PYTHONUNBUFFERED="1")
    env.update(extra or {})
    env.setdefault("JAX_PLATFORMS", "cpu")
    return env
