"""Data parallelism over the `dp` mesh axis.

Rules: `batch -> dp` (composed with FSDP's data axis in `plan.py`); parameters stay replicated.
Collectives: one gradient all-reduce over `dp` per step, of the full (local) gradient: 2(n-1)/n x
gradient bytes on the wire per device. Memory: every replica holds the whole model state
(16 bytes/param for mixed-precision Adam); activations are split n ways.
"""
from __future__ import annotations

from jaxscale.strategies.common import Collective, dtype_bytes

AXIS = "dp"
DATA_AXIS = True


def rules(rules) -> None:
    """DP adds no parameter rule: the batch rule is composed from all data axes in plan.py."""


def theory(cfg, mesh_cfg, local_param_elems: float) -> list[Collective]:
    if mesh_cfg.dp == 1:
        return []
    b = local_param_elems * dtype_bytes(cfg.model.param_dtype)
    return [Collective("all-reduce", ("dp",), b, what="gradients")]
