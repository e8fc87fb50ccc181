"""A parameter-server worker (`jaxscale.ps`): its own JAX program on its own devices, pulling,
computing and pushing without waiting for the other workers.

    python -m jaxscale.ps.worker CONFIG_JSON      (started by `supervisor.py`, which sets
                                                   JAXSCALE_PS_ADDRESS / _WORKER / _WORKERS)

The worker runs the run's plan on its devices (its mesh: the configured one when its degrees fit
the worker's device count, else data parallelism over them). `ps.mode=sgd`: per request, one
batch's gradients (`Setup.jit_grads`); `local`: `ps.local_steps` steps of the plan's own train
step with a local optimizer that persists across pushes, then the parameter change. `ps.slow`
makes a worker sleep so that each of its pushes takes that factor times its compute time.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import jax
import numpy as np

from jaxscale import config as config_lib
from jaxscale.data import make_batches
from jaxscale.mesh import MeshConfig
from jaxscale.ps import ADDRESS_ENV, WORKER_ENV, WORKERS_ENV, batch_index, flatten, wire
from jaxscale.train.setup import build


def worker_config(cfg, devices: int):
    """The run's config on a worker's `devices`: its mesh if it fits, else dp over them."""
    try:
        cfg.mesh.resolve(devices)
        return cfg
    except ValueError:
        return dataclasses.replace(cfg, mesh=MeshConfig(dp=-1, device_kind=cfg.mesh.device_kind))


class Worker:
    """One worker: `join`, then `pull` and `push` in turn until the server says done (`run`).
    `client` replaces the ZeroMQ connection to `address` (`jaxscale.ps.scheduled`)."""

    def __init__(self, cfg, worker: int, workers: int, address: str | None, devices=None,
                 client=None):
        self.cfg, self.w, self.n, self.ps = cfg, worker, workers, cfg.ps
        devices = list(devices or jax.devices())
        self.setup = build(worker_config(cfg, len(devices)), devices)
        self.client = client or wire.Client(address)
        self.treedef = jax.tree.structure(self.setup.abstract_state().params)
        self.position = self.pushes = 0
        self.train_b = make_batches(cfg.data)[0]
        self.sh = self.setup.batch_shardings()
        self.slow = cfg.ps.slow_factors().get(worker, 1.0)
        self.grads = self.setup.jit_grads() if self.ps.mode == "sgd" else None
        self.local = None                    # mode local: this worker's own train state

    def batch(self, position: int) -> dict:
        return self.train_b.device_batch(batch_index(self.w, self.n, position), self.sh)

    def compute(self, params, position: int):
        """(host arrays to push, loss, tokens, batches used) from `params` at `position`."""
        if self.ps.mode == "sgd":
            g, loss, ntok = self.grads(params, self.batch(position))
            return flatten(g)[0], float(loss), float(ntok), 1
        if self.local is None:
            self.local = self.setup.init_state()
        pulled = jax.device_get(params)
        self.local = dataclasses.replace(
            self.local, params=params,
            master=None if self.local.master is None else jax.tree.map(
                lambda p, m: p.astype(m.dtype), params, self.local.master))
        losses, tokens = [], 0.0
        for h in range(self.ps.local_steps):
            self.local, m = self.setup.train_step(
                self.local, self.setup.train_batch(self.batch(position + h)))
            losses.append(float(m["loss"]))
            tokens += float(m["tokens"])
        new = self.local.master if self.local.master is not None else self.local.params
        delta = jax.tree.map(lambda a, b: np.asarray(a, np.float32) - np.asarray(b, np.float32),
                             jax.device_get(new), pulled)
        return flatten(delta)[0], float(np.mean(losses)), tokens, self.ps.local_steps

    def join(self) -> dict:
        """Say hello; the server's answer (its step, this worker's data position, done)."""
        head, _ = self.client.request({"op": "hello", "worker": self.w})
        if "error" in head:
            raise ValueError(head["error"])
        mine = [list(x.shape) for x in jax.tree.leaves(self.setup.abstract_state().params)]
        if head["shapes"] != mine:
            raise ValueError(f"worker {self.w}'s parameters {mine} differ from the server's "
                             f"{head['shapes']}: the same model and vocabulary padding needed")
        self.position, self.pushes = head["position"], 0
        return head

    def pull(self):
        """(the server's step, its parameters on this worker's devices), or None when done."""
        head, leaves = self.client.request({"op": "pull", "worker": self.w})
        if head["done"]:
            return None
        return head["step"], jax.device_put(jax.tree.unflatten(self.treedef, leaves),
                                            self.setup.device_shardings.params)

    def push(self, pulled) -> dict:
        """Compute on the parameters `pull` gave (however many updates ago) at this worker's
        position and push the result; the server's answer."""
        step, params = pulled
        t0 = time.perf_counter()
        arrays, loss, tokens, used = self.compute(params, self.position)
        busy = time.perf_counter() - t0
        if self.slow > 1 and self.pushes:     # (the first compiles: not a step's time)
            time.sleep((self.slow - 1) * busy)
        head, _ = self.client.request(
            {"op": "push", "worker": self.w, "pulled": step, "position": self.position + used,
             "loss": loss, "tokens": tokens, "seconds": time.perf_counter() - t0}, arrays)
        if head.get("applied"):
            self.position += used
            self.pushes += 1
        return head

    def run(self) -> int:
        """Pull, compute, push until the server says done; the pushes it applied."""
        head = self.join()
        while not head["done"]:
            pulled = self.pull()
            if pulled is None:
                break
            head = self.push(pulled)
        self.client.close()
        return self.pushes


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cfg = config_lib.from_dict(json.loads(Path(argv[0]).read_text()))
    w, n = int(os.environ[WORKER_ENV]), int(os.environ[WORKERS_ENV])
    try:
        pushes = Worker(cfg, w, n, os.environ[ADDRESS_ENV]).run()
    except (ValueError, TimeoutError) as e:
        print(f"jaxscale ps worker {w}: error: {e}", file=sys.stderr, flush=True)
        return 1
    print(f"jaxscale ps worker {w}: done after {pushes} applied pushes", file=sys.stderr,
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
