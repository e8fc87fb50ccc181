"""The one vocabulary of collective costs: kinds, bus-bandwidth factors, ring steps, alpha-beta.

Every place that turns bytes into wire bytes or seconds reads this module: the census of the
compiled program (`jaxscale.analysis.inspect`), the planner's step-time model, the hand-written
collective algorithms and the nccl-tests-style benchmark.

- `busbw_factor(kind, n)`: wire bytes per device over the message size for a bandwidth-optimal
  (ring) algorithm, nccl-tests' busbw factor: all-reduce 2(n-1)/n; all-gather, reduce-scatter,
  all-to-all (n-1)/n; collective-permute and broadcast 1.
- `ring_steps(kind, n)`: sequential point-to-point steps of the ring algorithm (each pays the
  latency alpha once): all-reduce 2(n-1); all-gather, reduce-scatter, all-to-all, broadcast n-1;
  permute 1.
- `alpha_beta(steps, wire_bytes, alpha, bandwidth)`: t = steps x alpha + wire bytes / bandwidth
  (+ gamma x bytes reduced, the alpha-beta-gamma model, where reduction arithmetic matters).

Kinds are spelled as in HLO (`all-reduce`); the benchmark's `all_reduce` and `permute` spellings
are accepted too.
"""
from __future__ import annotations

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
         "broadcast")
_ALIASES = {"permute": "collective-permute"}


def kind_name(kind: str) -> str:
    """The HLO spelling of a collective kind (`all_reduce` -> `all-reduce`, `permute` ->
    `collective-permute`); an unknown kind is an error naming the valid ones."""
    k = _ALIASES.get(kind, kind.replace("_", "-"))
    if k not in KINDS:
        raise ValueError(f"unknown collective kind {kind!r}; valid: {', '.join(KINDS)}")
    return k


def busbw_factor(kind: str, n: int) -> float:
    """nccl-tests bus-bandwidth factor: busbw = algbw x factor (wire bytes = size x factor)."""
    k = kind_name(kind)
    if n < 1:
        raise ValueError(f"need at least one device, got n={n}")
    if k == "all-reduce":
        return 2 * (n - 1) / n
    if k in ("all-gather", "reduce-scatter", "all-to-all"):
        return (n - 1) / n
    return 1.0


def ring_steps(kind: str, n: int) -> int:
    """Sequential steps of the ring algorithm for `kind` on n devices (0 on one device)."""
    k = kind_name(kind)
    if n <= 1:
        return 0
    if k == "all-reduce":
        return 2 * (n - 1)
    if k == "collective-permute":
        return 1
    return n - 1


def alpha_beta(steps: float, wire_bytes: float, alpha: float, bandwidth: float,
               gamma: float = 0.0, reduced_bytes: float = 0.0) -> float:
    """Seconds: steps x alpha + wire_bytes / bandwidth (+ gamma x reduced_bytes)."""
    if alpha < 0 or bandwidth <= 0 or gamma < 0:
        raise ValueError(f"need alpha >= 0, bandwidth > 0, gamma >= 0; got {alpha}, {bandwidth}, "
                         f"{gamma}")
    return steps * alpha + wire_bytes / bandwidth + reduced_bytes * gamma
