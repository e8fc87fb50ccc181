"""Multi-process runs: `jax.distributed` initialisation and a one-machine launcher that supervises
its processes, restarts them from the last checkpoint, and (elastic) on fewer of them.

    jaxscale launch --processes 2 -- train llama_tiny --steps 50 --out runs/mp
    jaxscale launch --processes 2 --max-restarts 3 --elastic -- train llama_tiny --out runs/mp

starts 2 processes of `jaxscale train ...`, each with 4 simulated CPU devices (8 in all), CPU
collectives over gloo, process 0 hosting the coordinator on 127.0.0.1. Every process runs the
same program on its own devices; XLA inserts the cross-process collectives, so the loss equals
the one-process 8-device run's. Checkpoints are written by all processes (each its own shards)
into the same directory, which must be shared (it is, on one machine).

- `distributed`: `initialize_from_env()` (joining a job from the environment, by hand, from this
  launcher or under SLURM) and the environment the launcher gives its processes;
- `group`: one attempt: start the processes, stop them all on the first failure (under a second:
  the watchdog polls every 0.1 s and SIGKILLs the rest) or on a hang (heartbeat files of
  `jaxscale.train.supervise`; every process's Python stacks are dumped first);
- `restarts`: `launch()`: `--max-restarts N` reruns the command with `--resume` on a fresh
  coordinator port; `--elastic` on one process fewer after a process is lost;
- `elastic`: the mesh for the devices left (the same plan where a `-1` degree absorbs the
  change, else the nearest one that fits).

Without the launcher (SLURM, by hand): a process blocked in a collective with a dead peer gets a
gloo "connection reset" error at once, and leaves with status 75 (`supervise.EXIT_RESTARTABLE`)
where the training loop runs under `supervise.Monitor`; otherwise the coordination service
misses the dead process's heartbeats and terminates every process after
`JAXSCALE_HEARTBEAT_TIMEOUT` seconds (default 30; JAX's own default is 100), status 134.
Finalized checkpoints survive all of this: an interrupted save is only ever a tmp directory.

Signals: SIGTERM/SIGINT to the launcher are forwarded to every process (each in its own session,
so a terminal's Ctrl-C reaches them once, through the launcher); the processes agree on a step,
save it and exit 0. A second signal is forwarded too and makes them exit at once. A run stopped
by a signal is never restarted.
"""
from jaxscale.launch.distributed import (
    HEARTBEAT_TIMEOUT_S,
    _child_env,
    free_port,
    initialize_from_env,
)
from jaxscale.launch.restarts import Run, launch

__all__ = ["HEARTBEAT_TIMEOUT_S", "Run", "_child_env", "free_port", "initialize_from_env",
           "launch"]
