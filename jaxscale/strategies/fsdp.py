"""Fully sharded data parallelism (ZeRO-3) over the `fsdp` mesh axis.

Rules: parameters (and so gradients and optimizer state, which follow the parameter shardings)
are sharded on their `embed` dimension over `fsdp`; the batch is split over `fsdp` too.
Collectives per step: all-gather of each layer's parameters in the forward, again in the
backward where XLA does not keep the gathered copy, and a reduce-scatter of the gradients:
3 x parameter bytes x (n-1)/n on the wire per device (ZeRO-3's 3 Psi). Memory: model state
16/n bytes/param; one gathered layer (plus prefetch) of full parameters is live at a time.
"""
from __future__ import annotations

from jaxscale.strategies.common import Collective, dtype_bytes

AXIS = "fsdp"
DATA_AXIS = True


def rules(rules) -> None:
    rules.add("embed", "fsdp", by="fsdp")


def theory(cfg, mesh_cfg, gathered_param_elems: float, embedding_elems: float) -> list[Collective]:
    """`gathered_param_elems`: parameter elements per device once gathered over fsdp;
    `embedding_elems`: the (gathered) embedding table's share, which the backward does not
    gather again (its gradient is a scatter-add into the local shard)."""
    if mesh_cfg.fsdp == 1:
        return []
    b = dtype_bytes(cfg.model.param_dtype)
    full = gathered_param_elems * b
    return [Collective("all-gather", ("fsdp",), full, what="parameters, forward"),
            Collective("all-gather", ("fsdp",), full - embedding_elems * b,
                       what="parameters but the embedding, backward"),
            Collective("reduce-scatter", ("fsdp",), full, what="gradients")]
