"""Data parallelism over the `dp` mesh axis.

Rules: `batch -> dp` (composed with FSDP's data axis in `plan.py`); parameters stay replicated.
Collectives: one gradient all-reduce over `dp` per step, of the full (local) gradient: 2(n-1)/n x
gradient bytes on the wire per device. Memory: every replica holds the whole model state
(16 bytes/param for mixed-precision Adam); activations are split n ways.
"""
from __future__ import annotations

from jaxscale.strategies.common import Collective

AXIS = "dp"
DATA_AXIS = True


def rules(rules) -> None:
    """DP adds no parameter rule: the batch rule is composed from all data axes in plan.py."""


def theory(mesh_cfg, grad_bytes: float) -> list[Collective]:
    """`grad_bytes`: the per-device gradient (as sharded by the other strategies)."""
    if mesh_cfg.dp == 1:
        return []
    return [Collective("all-reduce", ("dp",), grad_bytes, what="gradients")]
