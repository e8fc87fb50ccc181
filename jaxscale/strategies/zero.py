"""ZeRO stages over the data-parallel `dp` axis (arXiv 1910.02054).

| stage | sharded over dp                    | model state bytes/param (mixed-precision Adam) |
|-------|------------------------------------|------------------------------------------------|
| 0     | nothing (plain DP)                 | 16                                             |
| 1     | optimizer moments + fp32 master    | 4 + 12/N                                       |
| 2     | + gradients (kept sharded)         | 2 + 14/N                                       |
| 3     | + working parameters (= FSDP)      | 16/N                                           |

Each sharded tensor is split over `dp` on one dimension: the one FSDP already shards (the two
axes then nest as ('dp', 'fsdp')), else the first unsharded dimension that `dp` divides; a tensor
with no such dimension stays replicated (norm scales of odd sizes, say).
Collectives per step: stage 1 all-reduces gradients (2 Psi), updates its shard and all-gathers the
new parameters (Psi); stage 2 reduce-scatters gradients (Psi) and all-gathers parameters (Psi):
2 Psi; stage 3 all-gathers parameters in forward and backward and reduce-scatters gradients:
3 Psi. (XLA may turn stage 1's all-reduce + slice into a reduce-scatter itself.)
"""
from __future__ import annotations

import math

from jax.sharding import PartitionSpec as P

from jaxscale.strategies.common import Collective

AXIS = "dp"


def shard_spec(spec: P, shape: tuple[int, ...], axis_sizes: dict[str, int], axis: str = AXIS) -> P:
    """`spec` with `axis` added on one dimension (see module docstring)."""
    n = axis_sizes.get(axis, 1)
    entries = list(spec) + [None] * (len(shape) - len(spec))
    if n == 1 or any(axis in _axes(e) for e in entries):
        return P(*entries)

    def local(i):
        return shape[i] // math.prod(axis_sizes[a] for a in _axes(entries[i]))
    order = [i for i, e in enumerate(entries) if "fsdp" in _axes(e)]
    order += [i for i, e in enumerate(entries) if e is None]
    for i in order:
        if local(i) % n == 0:
            entries[i] = (axis,) + _axes(entries[i]) if entries[i] else axis
            return P(*entries)
    return P(*entries)


def _axes(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def validate(plan_cfg, mesh_cfg) -> list[str]:
    z = plan_cfg.zero
    if z not in (0, 1, 2, 3):
        return [f"plan.zero={z}: ZeRO stages are 0, 1, 2 or 3"]
    if z and mesh_cfg.dp == 1:
        return [f"plan.zero={z} shards state over the dp axis, but mesh.dp=1: give devices to dp "
                f"(mesh.fsdp already shards parameters, gradients and optimizer state, = ZeRO-3)"]
    return []


def theory(stage: int, mesh_cfg, param_bytes: float, embedding_bytes: float, grad_bytes: float,
           micro_batches: int = 1) -> list[Collective]:
    """Per-device collectives over dp; bytes are whole (unsharded over dp) per-device tensors."""
    if stage == 0 or mesh_cfg.dp == 1:
        return []
    if stage in (1, 2):
        return [Collective("reduce-scatter", ("dp",), grad_bytes, what="gradients"),
                Collective("all-gather", ("dp",), param_bytes, what="updated parameters")]
    k = micro_batches
    return [Collective("all-gather", ("dp",), k * param_bytes, what="parameters, forward"),
            Collective("all-gather", ("dp",), k * (param_bytes - embedding_bytes),
                       what="parameters but the embedding, backward"),
            Collective("reduce-scatter", ("dp",), grad_bytes, what="gradients")]
