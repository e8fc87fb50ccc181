"""Asynchronous SGD: stale gradients, the step size they tolerate, and a parameter-server simulator.

Synchronous data parallelism waits for every worker each step; asynchronous SGD lets a parameter
server apply each worker's gradient as it arrives, computed on parameters that are already k
updates old (the staleness). Two models of that, both plain NumPy (no devices involved):

- `delayed_sgd`: every update uses the gradient of the iterate `delay` steps back,
  x_{t+1} = x_t - lr g(x_{t-k}). On a quadratic with curvature h this is stable iff
  lr h < 2 sin(pi / (2 (2k + 1))) (the roots of z^{k+1} - z^k + lr h stay inside the unit
  circle; k = 0 gives gradient descent's 2, k = 1 gives 1): `stable_lr` is that bound, and
  `divergence_lr` finds it by bisection on any problem, so a run shows where staleness breaks it.
- `parameter_server`: an event simulation of n workers of different speeds pulling the
  parameters, computing a gradient for a random time, and pushing it; the server applies each
  push at once, its staleness being the number of updates applied since that worker pulled
  (about n - 1 with equal speeds). `lr_rule="staleness"` divides the step by (1 + staleness)
  (Zhang et al., "Staleness-aware async-SGD", IJCAI 2016), which keeps fast-changing runs stable.

Problems (`Quadratic`, `SparseEmbedding`) give `loss(x)` and a stochastic `grad(x, rng)`; the
sparse one is the recommender-style case where each example touches a few embedding rows, so a
stale gradient rarely conflicts with the updates it missed, and asynchrony costs little.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

import numpy as np


# ----------------------------------------------------------------------------- problems
@dataclass
class Quadratic:
    """f(x) = 1/2 sum_i h_i (x_i - t_i)^2 with gradient noise `noise` (per coordinate)."""
    curvatures: np.ndarray
    target: np.ndarray
    noise: float = 0.0

    @classmethod
    def make(cls, dim: int = 32, h_max: float = 1.0, h_min: float = 0.1, noise: float = 0.0,
             seed: int = 0) -> "Quadratic":
        rng = np.random.default_rng(seed)
        return cls(np.linspace(h_min, h_max, dim), rng.normal(size=dim), noise)

    @property
    def h_max(self) -> float:
        return float(self.curvatures.max())

    def init(self) -> np.ndarray:
        return np.zeros_like(self.target)

    def loss(self, x) -> float:
        return float(0.5 * np.sum(self.curvatures * (x - self.target) ** 2))

    def grad(self, x, rng=None) -> np.ndarray:
        g = self.curvatures * (x - self.target)
        if self.noise and rng is not None:
            g = g + self.noise * rng.normal(size=g.shape)
        return g


@dataclass
class SparseEmbedding:
    """Recommender-style regression: example (u, v, y) with rows u of U and v of V, prediction
    <U_u, V_v>; a gradient touches 2 rows of the (rows x dim) tables."""
    users: int = 100
    items: int = 100
    dim: int = 4
    examples: int = 2000
    batch: int = 16
    seed: int = 0
    data: tuple = field(init=False)

    def __post_init__(self):
        rng = np.random.default_rng(self.seed)
        U, V = rng.normal(size=(self.users, self.dim)), rng.normal(size=(self.items, self.dim))
        u, v = rng.integers(0, self.users, self.examples), rng.integers(0, self.items,
                                                                          self.examples)
        self.data = (u, v, np.sum(U[u] * V[v], axis=1) / math.sqrt(self.dim))

    def init(self) -> np.ndarray:
        rng = np.random.default_rng(self.seed + 1)
        return 0.1 * rng.normal(size=((self.users + self.items) * self.dim,))

    def _split(self, x):
        t = x.reshape(self.users + self.items, self.dim)
        return t[:self.users], t[self.users:]

    def loss(self, x) -> float:
        U, V = self._split(x)
        u, v, y = self.data
        return float(0.5 * np.mean((np.sum(U[u] * V[v], axis=1) / math.sqrt(self.dim) - y) ** 2))

    def grad(self, x, rng) -> np.ndarray:
        U, V = self._split(x)
        u, v, y = self.data
        i = rng.integers(0, len(y), self.batch)
        r = (np.sum(U[u[i]] * V[v[i]], axis=1) / math.sqrt(self.dim) - y[i]) / self.batch
        g = np.zeros((self.users + self.items, self.dim))
        np.add.at(g, u[i], r[:, None] * V[v[i]] / math.sqrt(self.dim))
        np.add.at(g, self.users + v[i], r[:, None] * U[u[i]] / math.sqrt(self.dim))
        return g.ravel()


# ----------------------------------------------------------------------------- fixed delay
def stable_lr(curvature: float, delay: int) -> float:
    """The largest step size for which gradient descent with gradients `delay` steps stale
    converges on a quadratic of this curvature: 2 sin(pi / (2 (2k + 1))) / h."""
    if delay < 0 or curvature <= 0:
        raise ValueError(f"need delay >= 0 and curvature > 0, got delay={delay}, "
                         f"curvature={curvature}")
    return 2 * math.sin(math.pi / (2 * (2 * delay + 1))) / curvature


def delayed_sgd(problem, lr: float, delay: int, steps: int, seed: int = 0,
                blowup: float = 1e6) -> np.ndarray:
    """Loss after each step of x_{t+1} = x_t - lr g(x_{t-delay}); stops (the rest inf) once the
    loss exceeds `blowup` times the initial loss."""
    if delay < 0 or steps < 1 or lr <= 0:
        raise ValueError(f"need delay >= 0, steps >= 1 and lr > 0; got delay={delay}, "
                         f"steps={steps}, lr={lr}")
    rng = np.random.default_rng(seed)
    x = problem.init()
    history = [x.copy()] * (delay + 1)          # x_{t-delay} .. x_t
    start = max(problem.loss(x), 1e-12)
    out = np.full(steps, np.inf)
    for t in range(steps):
        x = x - lr * problem.grad(history[0], rng)
        history = history[1:] + [x.copy()]
        out[t] = problem.loss(x)
        if not np.isfinite(out[t]) or out[t] > blowup * start:
            out[t] = np.inf
            break
    return out


def divergence_lr(problem, delay: int, steps: int = 2000, lo: float = 1e-4, hi: float = 10.0,
                  iters: int = 30) -> float:
    """The step size where delayed SGD stops converging, by bisection: a run converges when its
    final loss is below its first."""
    def converges(lr):
        curve = delayed_sgd(problem, lr, delay, steps)
        return np.isfinite(curve[-1]) and curve[-1] < curve[0]
    if not converges(lo):
        raise ValueError(f"delayed SGD does not converge even at lr={lo}; lower `lo`")
    for _ in range(iters):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if converges(mid) else (lo, mid)
    return lo


# ----------------------------------------------------------------------------- parameter server
@dataclass
class PSResult:
    loss: np.ndarray            # after each server update
    staleness: np.ndarray       # of each applied gradient
    time: np.ndarray            # simulated time of each update
    per_worker: np.ndarray      # updates applied per worker


def parameter_server(problem, n_workers: int, lr: float, updates: int,
                     speeds: np.ndarray | None = None, lr_rule: str = "constant",
                     jitter: float = 0.3, seed: int = 0) -> PSResult:
    """Asynchronous SGD against one parameter server. Worker w needs (1 + jitter x uniform) /
    speeds[w] time units per gradient; the server applies each push at once, with step lr
    (`lr_rule="constant"`) or lr / (1 + staleness) ("staleness"). A diverging run stops, the
    rest of its losses inf."""
    if n_workers < 1 or updates < 1:
        raise ValueError(f"need n_workers >= 1 and updates >= 1; got {n_workers}, {updates}")
    if lr_rule not in ("constant", "staleness"):
        raise ValueError(f"lr_rule={lr_rule!r}: valid are 'constant', 'staleness'")
    speeds = np.ones(n_workers) if speeds is None else np.asarray(speeds, float)
    if speeds.shape != (n_workers,) or np.any(speeds <= 0):
        raise ValueError(f"speeds must be {n_workers} positive numbers, got {speeds}")
    rng = np.random.default_rng(seed)
    x, version = problem.init(), 0
    events = []                                    # (finish time, worker, pulled version, x)
    for w in range(n_workers):
        heapq.heappush(events, (_work(rng, speeds[w], jitter), w, 0, x.copy()))
    loss, stale, times = np.full(updates, np.inf), np.zeros(updates, int), np.zeros(updates)
    per = np.zeros(n_workers, int)
    start = max(problem.loss(x), 1e-12)
    for u in range(updates):
        t, w, pulled, x_old = heapq.heappop(events)
        s = version - pulled
        step = lr / (1 + s) if lr_rule == "staleness" else lr
        x = x - step * problem.grad(x_old, rng)
        version += 1
        loss[u], stale[u], times[u] = problem.loss(x), s, t
        per[w] += 1
        if not loss[u] < 1e6 * start:                 # diverged: the rest stays inf
            loss[u] = np.inf
            break
        heapq.heappush(events, (t + _work(rng, speeds[w], jitter), w, version, x.copy()))
    return PSResult(loss, stale, times, per)


def _work(rng, speed: float, jitter: float) -> float:
    return (1 + jitter * rng.uniform()) / speed
