"""The alpha-beta cost model of the hand-written collectives in `jaxscale.comm.algorithms`.

Alpha-beta model (`predict_time`, through `jaxscale.cost`, the one the planner and the census use):
t = steps * alpha + S * factor / bandwidth, where factor is the algorithm's bytes on the wire over
S. For the bandwidth-optimal algorithms it is the nccl-tests busbw factor
(`jaxscale.cost.busbw_factor`): all-reduce 2(n-1)/n; all-gather, reduce-scatter, all-to-all
(n-1)/n; broadcast and permute 1.

- `cost(algorithm, kind, S, n)`: the `Cost` (sequential steps, bytes each device sends, bytes it
  adds) of one of `ALGORITHMS` for one of `KINDS`; `wire_bytes` and `predict_time` read it.
- `Link`, `hierarchical_time`, `flat_ring_time`: the two-level all-reduce against a flat ring
  over the same devices when the inter-node link is slower than the intra-node one.
- `fit_alpha_beta(sizes, times)`: alpha and bandwidth fitted to measured times.

Pure Python: imports no jax.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from jaxscale import cost as cost_lib

#: Collective kinds of the benchmark and of the cost model.
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "permute")
#: Algorithms of the cost model; `algorithms.all_reduce` runs the ones that are all-reduces.
ALGORITHMS = ("ring", "halving_doubling", "recursive_doubling", "hierarchical")
_MODEL_KINDS = {
    "ring": KINDS,
    "halving_doubling": ("all_reduce", "reduce_scatter", "all_gather"),
    "recursive_doubling": ("all_reduce",),
    "hierarchical": ("all_reduce",),
}


def check_power_of_two(n: int, what: str, axis_name: str | tuple[str, ...]) -> None:
    """Refuse an axis (or device count) `n` that is not a power of two, for algorithm `what`."""
    if n < 1 or n & (n - 1):
        raise ValueError(
            f"{what} needs a power-of-two axis size, but axis {axis_name!r} has {n} devices. "
            f"Use ring_all_reduce (any size), or a mesh whose axis size is 2, 4, 8, ...")


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown collective kind {kind!r}; valid: {', '.join(KINDS)}")


@dataclass(frozen=True)
class Cost:
    """Sequential steps (each paying alpha once), bytes each device sends, bytes it adds."""
    steps: int
    wire_bytes: float
    reduced_bytes: float = 0.0

    def time(self, alpha: float, bandwidth: float, gamma: float = 0.0) -> float:
        """alpha-beta(-gamma) (`jaxscale.cost.alpha_beta`): gamma is seconds per byte reduced
        (0: transfers only)."""
        return cost_lib.alpha_beta(self.steps, self.wire_bytes, alpha, bandwidth, gamma,
                                   self.reduced_bytes)


def cost(algorithm: str, kind: str, nbytes: float, n: int, *, n_inner: int | None = None) -> Cost:
    """Steps and per-device wire bytes of `algorithm` for `kind` on n devices, S = `nbytes`.

    `nbytes` is the full per-device buffer: the all-gather output, the reduce-scatter input.
    Ring all-to-all is the pairwise exchange (n-1 steps of S/n); ring broadcast the pipelined
    chain in its large-message limit (n-1 steps, S through every link). `n_inner` (hierarchical
    only) is the inner group size; it must divide n.
    """
    _check_kind(kind)
    if algorithm not in _MODEL_KINDS:
        raise ValueError(f"unknown algorithm {algorithm!r}; valid: {', '.join(ALGORITHMS)}")
    if kind not in _MODEL_KINDS[algorithm]:
        raise ValueError(f"algorithm {algorithm!r} has no {kind}; it models "
                         f"{', '.join(_MODEL_KINDS[algorithm])}")
    if n < 1:
        raise ValueError(f"need at least one device, got n={n}")
    S = float(nbytes)
    reduces = kind in ("all_reduce", "reduce_scatter")
    if algorithm == "ring":
        if n == 1:
            return Cost(0, 0.0)
        return Cost(cost_lib.ring_steps(kind, n), S * cost_lib.busbw_factor(kind, n),
                    S * (n - 1) / n if reduces else 0.0)
    if algorithm == "hierarchical":
        if not n_inner or n % n_inner:
            raise ValueError(f"hierarchical needs n_inner dividing n={n}, got {n_inner}")
        a, b = n_inner, n // n_inner
        return Cost(2 * (a - 1) + 2 * (b - 1), S * (2 * (a - 1) / a + 2 * (b - 1) / (a * b)),
                    S * ((a - 1) / a + (b - 1) / (a * b)))
    check_power_of_two(n, algorithm, "n")
    k = n.bit_length() - 1
    if algorithm == "recursive_doubling":
        return Cost(k, S * k, S * k)
    steps = 2 * k if kind == "all_reduce" else k
    return Cost(steps, S * cost_lib.busbw_factor(kind, n), S * (n - 1) / n if reduces else 0.0)


def wire_bytes(algorithm: str, kind: str, nbytes: float, n: int, *,
               n_inner: int | None = None) -> float:
    """Theoretical bytes each device sends for one collective."""
    return cost(algorithm, kind, nbytes, n, n_inner=n_inner).wire_bytes


def predict_time(algorithm: str, kind: str, nbytes: float, n: int, alpha: float,
                 bandwidth: float, *, n_inner: int | None = None, gamma: float = 0.0) -> float:
    """t = steps * alpha + S * factor / bandwidth (seconds; alpha in s, bandwidth in bytes/s).

    `gamma` > 0 adds the reduction arithmetic, gamma * bytes added per device (the alpha-beta-
    gamma model); it matters where devices share compute, as simulated CPU devices do.
    """
    return cost(algorithm, kind, nbytes, n, n_inner=n_inner).time(alpha, bandwidth, gamma)


@dataclass(frozen=True)
class Link:
    """One class of link: per-message latency (s) and per-device bandwidth (bytes/s, one way)."""
    alpha: float
    bandwidth: float


def hierarchical_time(nbytes: float, n_inner: int, n_outer: int, intra: Link,
                      inter: Link) -> float:
    """Two-level all-reduce: inner ring RS + AG over `intra`, outer ring AR of S/a over `inter`.

    Assumes every device has its own inter-node link (one NIC per GPU, as on DGX nodes), so
    the a outer rings run side by side.
    """
    a, b = n_inner, n_outer
    t = 2 * (a - 1) * (intra.alpha + nbytes / (a * intra.bandwidth))
    return t + 2 * (b - 1) * (inter.alpha + nbytes / (a * b * inter.bandwidth))


def flat_ring_time(nbytes: float, n_inner: int, n_outer: int, intra: Link, inter: Link) -> float:
    """Ring all-reduce over all a*b devices laid out node by node.

    Each of the 2(N-1) steps is synchronous, and with more than one node b hops of the ring cross
    nodes, so every step moves S/N over the slower link.
    """
    n = n_inner * n_outer
    link = inter if n_outer > 1 else intra
    slow = Link(max(intra.alpha, link.alpha), min(intra.bandwidth, link.bandwidth))
    return 2 * (n - 1) * (slow.alpha + nbytes / (n * slow.bandwidth))


def fit_alpha_beta(sizes: Sequence[float], times: Sequence[float]) -> tuple[float, float]:
    """Fit t = alpha + S / bandwidth to measured (S, t); returns (alpha, bandwidth).

    Least squares on relative errors ((model - t) / t), so that microsecond points at small S
    weigh as much as millisecond points at large S. alpha is clamped at 0; a non-positive slope
    (times not growing with size) is an error.
    """
    if len(sizes) != len(times) or len(sizes) < 2:
        raise ValueError("fit_alpha_beta needs at least two (size, time) pairs of equal length")
    if len(set(sizes)) < 2 or min(times) <= 0:
        raise ValueError("fit_alpha_beta needs two different sizes and positive times")
    # minimise sum ((alpha + slope*S) / t - 1)^2: normal equations of a 2x2 system
    w = [1.0 / t for t in times]
    a11 = sum(x * x for x in w)
    a12 = sum(x * x * s for x, s in zip(w, sizes))
    a22 = sum((x * s) ** 2 for x, s in zip(w, sizes))
    b1, b2 = sum(w), sum(x * s for x, s in zip(w, sizes))
    det = a11 * a22 - a12 * a12
    alpha, slope = (b1 * a22 - b2 * a12) / det, (a11 * b2 - a12 * b1) / det
    if alpha < 0:  # refit through the origin
        alpha, slope = 0.0, b2 / a22
    if slope <= 0:
        raise ValueError("measured times do not grow with message size; cannot fit a bandwidth")
    return alpha, 1.0 / slope
