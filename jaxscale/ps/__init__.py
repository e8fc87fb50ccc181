"""Asynchronous training through a parameter server: N worker processes that never wait for each
other (`jaxscale launch --async --workers N -- train ...`).

Processes: one server (`server.py`, one CPU device: the parameters, the optimizer state, the
checkpoints, metrics.jsonl) and N workers (`worker.py`), each its own JAX program on its own
devices with the plan's step. The transport is ZeroMQ (`wire.py`: REQ/ROUTER sockets over TCP,
localhost on one machine, any reachable host on a cluster). A worker pulls the current
parameters, computes on its own batches (worker w of N takes batches w, w + N, w + 2N, ... of the
run's data stream) and pushes the result; the server applies each push as it arrives and answers
at once, so a slow worker delays only its own pushes. `scheduled.py` drives the same server and
workers in one thread with the pushes in a given order: an interleaving, and so every push's
staleness, chosen rather than left to the processes' speeds (tests, studies).

Modes (`ps.mode`):
- `sgd` (asynchronous SGD, Downpour-style): a push is one batch's gradients; the server runs the
  run's optimizer (clip, AdamW/SGD and its schedule) on them.
- `local` (asynchronous local SGD): a worker takes `ps.local_steps` steps with its own optimizer
  from the pulled parameters and pushes the change; the server adds `ps.outer_lr` x the change.

Staleness: a push's staleness is the number of updates the server applied between the worker's
pull and its push (with N equal workers about N - 1). The server records it per push
(metrics.jsonl `staleness`, the summary's histogram) and applies `ps.step_rule`:
- `constant`: the push as it is;
- `staleness`: its update scaled by 1 / (1 + staleness) (Zhang et al., "Staleness-aware
  async-SGD", IJCAI 2016: lr / staleness);
- `dc`: delay-compensated gradients, g + lambda g * g * (w_now - w_pulled) (Zheng et al.,
  "Asynchronous SGD with delay compensation", ICML 2017; `ps.dc_lambda`), from the copy of the
  parameters the worker pulled, which the server keeps per worker.
`ps.max_staleness` > 0 drops staler pushes (the worker redoes that batch on fresher parameters).
`ps.barrier=true` makes the same server synchronous (the baseline the asynchronous runs are
measured against): it holds each push until every worker's is in and applies their
token-weighted mean once, so every step waits for the slowest worker.

Communication per push: the parameters down and the gradients (or the change) up, 2 x the
parameter bytes per worker step (local: per `ps.local_steps` steps), point to point with the
server: it saves every synchronisation wait at the cost of stale updates and a server link
that carries N workers' traffic. Memory: the server holds one fp32 copy of the parameters and
the optimizer state (plus one copy per worker under `dc`); a worker, its step's usual state.

Checkpoints: the server saves its state as an ordinary jaxscale checkpoint (train state, every
`ckpt.every` updates and at the end), with the workers' positions in the data stream; `--resume`
continues from it, each worker from its position. A killed worker is restarted by the
supervisor and rejoins from the current parameters; a killed server ends the run, and the same
command with `--resume` continues it.
"""
from __future__ import annotations

import numpy as np

#: environment of the server and worker processes (set by `supervisor.py`)
ADDRESS_ENV, WORKER_ENV, WORKERS_ENV = ("JAXSCALE_PS_ADDRESS", "JAXSCALE_PS_WORKER",
                                        "JAXSCALE_PS_WORKERS")


def batch_index(worker: int, workers: int, position: int) -> int:
    """The data stream's batch a worker reads at its `position`-th batch."""
    return worker + workers * position


def flatten(tree) -> tuple[list[np.ndarray], object]:
    """(host arrays in tree order, the tree's structure)."""
    import jax
    leaves, treedef = jax.tree.flatten(jax.device_get(tree))
    return [np.asarray(x) for x in leaves], treedef


def staleness_scale(rule: str, staleness: int) -> float:
    """The factor `ps.step_rule` applies to a push's update."""
    return 1.0 / (1.0 + staleness) if rule == "staleness" else 1.0
