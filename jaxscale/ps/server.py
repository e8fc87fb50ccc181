"""The parameter server (`jaxscale.ps`): the train state on one CPU device, each push applied as it
arrives, metrics, evaluation and checkpoints.

    python -m jaxscale.ps.server CONFIG_JSON OUT [--resume]      (started by `supervisor.py`)

One thread serves every request in arrival order (`wire.py`), so pushes are applied one at a
time, in the order they arrive. Each applied push is a metrics.jsonl row: the new step, the
worker, its loss, the push's staleness and the factor its update took, and the wall time since
the start (`time_s`); evaluation runs every `train.eval_every` updates on the server's copy.
"""
from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections import Counter
from pathlib import Path

import jax
import numpy as np
import optax

from jaxscale import config as config_lib
from jaxscale.data import make_batches
from jaxscale.mesh import MeshConfig
from jaxscale.ps import ADDRESS_ENV, WORKERS_ENV, flatten, staleness_scale, wire
from jaxscale.train import checkpoint as ckpt_lib
from jaxscale.train import checkpoint_meta as ckpt_meta
from jaxscale.train import disk
from jaxscale.train.loop import evaluate
from jaxscale.train.metrics import MetricsWriter, plot_loss, read_metrics
from jaxscale.train.setup import build

#: after the last update, how long the server keeps answering "done" to workers still asking
DRAIN_S = 30.0


def server_config(cfg):
    """The run's config on the server's one CPU device."""
    return dataclasses.replace(cfg, mesh=MeshConfig(device_kind=cfg.mesh.device_kind))


def make_apply(setup, ps):
    """(state, pushed tree, scale, pulled parameters) -> state: one push applied (`sgd`: the
    optimizer on the gradients, its update scaled; `local`: the change times outer_lr x scale)."""
    opt, policy = setup.optimizer, setup.policy

    def apply(state, pushed, scale, pulled):
        target = state.master if state.master is not None else state.params
        if ps.mode == "local":
            new_opt = state.opt_state
            new = jax.tree.map(lambda w, d: w + (ps.outer_lr * scale * d).astype(w.dtype),
                               target, pushed)
        else:
            if ps.step_rule == "dc":
                pushed = jax.tree.map(lambda g, w, w0: g + ps.dc_lambda * g * g * (
                    w.astype(g.dtype) - w0.astype(g.dtype)), pushed, target, pulled)
            norm = optax.tree.norm(pushed)
            updates, new_opt = opt.update(pushed, state.opt_state, target, grad_norm=norm)
            new = optax.apply_updates(target, jax.tree.map(lambda u: u * scale, updates))
        return dataclasses.replace(state, step=state.step + 1, params=policy.working(new),
                                   opt_state=new_opt,
                                   master=new if state.master is not None else None)
    return jax.jit(apply, donate_argnums=(0,))


class Server:
    """The server's state and its answers (`handle`); `serve` answers the ZeroMQ socket on
    `address` (None: no socket, the requests handed to `handle` directly, `scheduled.py`)."""

    def __init__(self, cfg, out: Path, workers: int, address: str | None, resume: bool,
                 device=None):
        self.cfg, self.out, self.workers, self.ps = cfg, Path(out), workers, cfg.ps
        self.setup = build(server_config(cfg), [device or jax.devices()[0]])
        self.order = self.setup.layout.layer_order
        ckdir = ckpt_meta.directory_for(cfg, self.out)
        self.positions = {w: 0 for w in range(workers)}
        if resume:
            self.ckpt, state, meta, _ = ckpt_lib.restore_latest(
                ckdir, cfg.ckpt, server_config(cfg), self.setup.abstract_state(), self.order)
            saved = meta.get("ps") or {}
            if saved.get("workers") != workers:
                raise ValueError(f"the checkpoint in {ckdir} was written with "
                                 f"{saved.get('workers')} workers; resume with --workers "
                                 f"{saved.get('workers')} (each worker's data position "
                                 f"depends on the worker count)")
            self.positions = {int(w): p for w, p in saved["positions"].items()}
        else:
            ckpt_meta.refuse_overwrite(ckdir)
            self.ckpt = ckpt_lib.Checkpointer(ckdir, cfg.ckpt)
            state = self.setup.init_state()
        self.state = state
        self.step = int(jax.device_get(state.step))
        self.start = self.step
        self.apply = make_apply(self.setup, self.ps)
        self.pulled: dict[int, tuple[int, object]] = {}
        self.waiting: dict[int, tuple] = {}        # ps.barrier: this round's pushes
        self.identities: dict[bytes, int] = {}     # ZeroMQ identity -> worker
        self.staleness: Counter = Counter()
        self.dropped = self.applied = 0
        self.sock = wire.bind(address) if address else None
        self.out.mkdir(parents=True, exist_ok=True)
        config_lib.save(cfg, self.out / "config.json")
        self.writer = MetricsWriter(self.out, resume_step=self.step if resume else None)
        self.eval_b = make_batches(cfg.data)[1]
        self.evals: list[float] = []
        self.t0 = time.perf_counter()

    @property
    def done(self) -> bool:
        return self.step >= self.cfg.train.steps

    def _target(self):
        return self.state.master if self.state.master is not None else self.state.params

    def handle(self, identity: bytes, head: dict, arrays: list) -> list[tuple]:
        """The replies (identity, header, arrays) a request releases: its own, none yet (a
        push waiting for its round under `ps.barrier`), or the whole round's."""
        w, op = int(head.get("worker", -1)), head.get("op")
        if not 0 <= w < self.workers:
            return [(identity, {"error": f"worker {w} is not one of the {self.workers}"}, [])]
        if op == "hello":
            return [(identity, {"step": self.step, "position": self.positions[w],
                                "done": self.done, "shapes": [list(x.shape) for x in
                                                              jax.tree.leaves(self.state.params)]},
                     [])]
        if op == "pull":
            leaves, _ = flatten(self.state.params)
            if self.ps.step_rule == "dc":        # what this worker's gradient will be late to
                self.pulled[w] = (self.step, jax.tree.map(lambda a: a.copy(), self._target()))
            else:
                self.pulled[w] = (self.step, None)
            return [(identity, {"step": self.step, "done": self.done}, leaves)]
        if op == "push":
            if self.ps.barrier and not self.done:
                return self._round(w, identity, head, arrays)
            return [(identity, self._push(w, head, arrays), [])]
        return [(identity, {"error": f"unknown request {op!r}"}, [])]

    def _round(self, w: int, identity: bytes, head: dict, arrays: list) -> list[tuple]:
        """`ps.barrier`: hold the push until every worker's is in, then apply their token-
        weighted mean once (synchronous data parallelism through the same server)."""
        self.waiting[w] = (identity, head, arrays)
        if len(self.waiting) < self.workers:
            return []
        tokens = {v: max(float(h["tokens"]), 1.0) for v, (_, h, _) in self.waiting.items()}
        total = sum(tokens.values())
        mean = [sum(np.asarray(a[i], np.float32) * (tokens[v] / total)
                    for v, (_, _, a) in self.waiting.items())
                for i in range(len(arrays))]
        loss = sum(float(h["loss"]) * tokens[v] for v, (_, h, _) in self.waiting.items()) / total
        first = min(self.waiting)
        merged = dict(self.waiting[first][1], loss=loss, tokens=total)
        answer = self._push(first, merged, mean)
        if answer.get("applied"):           # every worker of the round moves on
            self.positions.update({v: int(h["position"]) for v, (_, h, _) in
                                   self.waiting.items()})
        out = [(ident, answer, []) for ident, _, _ in self.waiting.values()]
        self.waiting = {}
        return out

    def _push(self, w: int, head: dict, arrays: list) -> dict:
        if self.done:
            return {"step": self.step, "applied": False, "done": True}
        pulled_step, pulled = self.pulled.pop(w, (head["pulled"], None))
        stale = self.step - int(pulled_step)
        finite = all(np.isfinite(a).all() for a in arrays) and np.isfinite(head["loss"])
        bound = self.ps.max_staleness
        if not finite or (bound and stale > bound):
            self.dropped += 1
            return {"step": self.step, "applied": False, "staleness": stale, "done": False,
                    "why": "non-finite" if not finite else f"staleness {stale} > {bound}"}
        treedef = jax.tree.structure(self.state.params)
        pushed = jax.tree.unflatten(treedef, [np.asarray(a, np.float32) for a in arrays])
        scale = staleness_scale(self.ps.step_rule, stale)
        self.state = self.apply(self.state, pushed, np.float32(scale),
                                pulled if pulled is not None else pushed)
        self.step += 1
        self.applied += 1
        self.staleness[stale] += 1
        self.positions[w] = int(head["position"])
        row = {"step": self.step, "loss": float(head["loss"]), "worker": w, "staleness": stale,
               "scale": scale, "time_s": time.perf_counter() - self.t0,
               "worker_seconds": float(head.get("seconds", 0.0))}
        every = self.cfg.train.eval_every
        if every and (self.step % every == 0 or self.done):
            row["eval_loss"] = evaluate(self.setup, self.state.params, self.eval_b,
                                        self.cfg.train.eval_batches)
            self.evals.append(row["eval_loss"])
        self.writer.write(row)
        if (self.cfg.ckpt.every and self.step % self.cfg.ckpt.every == 0) or self.done:
            self.save(row)
        return {"step": self.step, "applied": True, "staleness": stale, "done": self.done}

    def save(self, row=None) -> None:
        kept = disk.to_disk(self.state, self.cfg.model.vocab_size, self.order)
        meta = ckpt_meta.make_meta(
            server_config(self.cfg), kept, self.step, row,
            extra={"ps": {"workers": self.workers,
                          "positions": {str(w): p for w, p in self.positions.items()}}})
        self.ckpt.save(self.step, kept, meta)

    def serve(self) -> dict:
        """Answer requests until the last update, then until the workers have left (or for
        DRAIN_S); the summary."""
        told: set[int] = set()
        drain_until = None
        while True:
            if self.done:
                drain_until = drain_until or time.monotonic() + DRAIN_S
                if len(told) == self.workers or time.monotonic() > drain_until:
                    break
            got = wire.receive(self.sock, 200)
            if got is None:
                continue
            self.identities[got[0]] = int(got[1].get("worker", -1))
            for ident, answer, out in self.handle(*got):
                if answer.get("done"):
                    told.add(self.identities.get(ident, -1))
                wire.reply(self.sock, ident, answer, out)
        self.ckpt.wait()
        return self.finish()

    def finish(self) -> dict:
        self.writer.close()
        self.ckpt.close()
        if self.sock is not None:
            self.sock.close()
        total = sum(self.staleness.values())
        summary = {"steps": self.step, "workers": self.workers, "mode": self.ps.mode,
                   "step_rule": self.ps.step_rule, "applied": self.applied,
                   "dropped": self.dropped, "resumed_from": self.start or None,
                   "staleness_histogram": {str(k): v for k, v in sorted(self.staleness.items())},
                   "mean_staleness": (sum(k * v for k, v in self.staleness.items()) / total
                                      if total else None),
                   "last_eval_loss": self.evals[-1] if self.evals else None,
                   "seconds": time.perf_counter() - self.t0, "out": str(self.out)}
        plot_loss(read_metrics(self.out / "metrics.jsonl"), self.out / "loss.png",
                  f"{self.cfg.name}: asynchronous, {self.workers} workers")
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        return summary


def main(argv: list[str] | None = None) -> int:
    import os
    argv = sys.argv[1:] if argv is None else argv
    cfg = config_lib.from_dict(json.loads(Path(argv[0]).read_text()))
    try:
        server = Server(cfg, Path(argv[1]), int(os.environ[WORKERS_ENV]),
                        os.environ[ADDRESS_ENV], "--resume" in argv)
    except ValueError as e:
        print(f"jaxscale ps server: error: {e}", file=sys.stderr, flush=True)
        return 2
    print(f"jaxscale ps server: listening on {os.environ[ADDRESS_ENV]} for "
          f"{server.workers} workers, from step {server.step}", file=sys.stderr, flush=True)
    print(json.dumps(server.serve(), indent=2), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
