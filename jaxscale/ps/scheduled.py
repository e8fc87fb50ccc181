"""The parameter server with its workers' pushes arriving in a given order: asynchronous training
made reproducible, for tests and for studies of a chosen interleaving.

    run_scheduled(cfg, out, workers=3, order=[0, 1, 0, 1, 2] * 6)

runs the same `Server` and `Worker`s as `supervisor.run` (the same requests, encoded and decoded
by `wire.py`), in one thread: every worker joins and pulls at the start; then, for each worker
id of `order` in turn, that worker computes on the parameters it pulled last, pushes, and pulls
again at once, as a running worker does after each answer. A push's staleness is therefore
exactly the number of other workers' pushes in `order` since that worker's previous one
(since the start for its first): `[0, 1, 2, 3]` repeated gives staleness 0, 1, 2, 3, then
3 for every push; a worker that comes once for every k pushes of the others is k stale.

Where the real processes interleave their pushes by their speed (and the machine's load), here
the order says it; what the server does with each push (staleness, `ps.step_rule`,
`ps.max_staleness`, the metrics row, checkpoints) is the same code. `ps.barrier` holds pushes
for a round, which one thread cannot drive: it is refused.
"""
from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from jaxscale.ps import wire


class Direct:
    """A worker's client whose requests go straight to an in-process `Server.handle`."""

    def __init__(self, server, worker: int):
        self.server, self.identity = server, f"worker-{worker}".encode()

    def request(self, header: dict, arrays=()) -> tuple[dict, list]:
        head, arrays = wire.decode(wire.encode(header, arrays))
        replies = [(h, a) for ident, h, a in self.server.handle(self.identity, head, arrays)
                   if ident == self.identity]
        if not replies:
            raise RuntimeError(f"the server held {header.get('op')!r} of {self.identity!r}: "
                               f"run_scheduled cannot drive ps.barrier rounds")
        return wire.decode(wire.encode(*replies[0]))

    def close(self) -> None:
        pass


def run_scheduled(cfg, out: Path, workers: int, order: Iterable[int], resume: bool = False,
                  devices=None) -> dict:
    """Train `cfg` with `workers` workers whose pushes arrive in `order` (worker ids; it must
    last until the server's last update), worker w on device w (mod the devices), the server on
    the first. The server's summary, with each worker's applied pushes."""
    import jax

    from jaxscale.ps.server import Server
    from jaxscale.ps.worker import Worker
    if cfg.ps.barrier:
        raise ValueError("run_scheduled drives asynchronous pushes one at a time; ps.barrier "
                         "holds them for a round: use supervisor.run_in_process")
    devs = list(devices or jax.devices())
    server = Server(cfg, Path(out), workers, None, resume, device=devs[0])
    crew = [Worker(cfg, w, workers, None, [devs[w % len(devs)]], client=Direct(server, w))
            for w in range(workers)]
    pulled = {w.w: None if w.join()["done"] else w.pull() for w in crew}
    for w in order:
        if server.done:
            break
        if not 0 <= w < workers:
            raise ValueError(f"order names worker {w}; the workers are 0..{workers - 1}")
        pulled[w] = None if crew[w].push(pulled[w])["done"] else crew[w].pull()
    if not server.done:
        raise ValueError(f"the order ended after {server.step} of {cfg.train.steps} updates")
    server.ckpt.wait()
    summary = server.finish()
    summary["pushes_by_worker"] = {str(w.w): w.pushes for w in crew}
    return summary
