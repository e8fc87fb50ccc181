"""Fully sharded data parallelism (ZeRO-3) over the `fsdp` mesh axis.

Rules: parameters (and so gradients and optimizer state, which follow the parameter shardings)
are sharded on their `embed` dimension over `fsdp`; the batch is split over `fsdp` too.
Collectives per step: all-gather of each layer's parameters in the forward, again in the
backward where XLA does not keep the gathered copy, and a reduce-scatter of the gradients:
3 x parameter bytes x (n-1)/n on the wire per device (ZeRO-3's 3 Psi). Memory: model state
16/n bytes/param; one gathered layer (plus prefetch) of full parameters is live at a time.
"""
from __future__ import annotations

from jaxscale.strategies.common import Collective

AXIS = "fsdp"
DATA_AXIS = True


def rules(rules) -> None:
    rules.add("embed", "fsdp", by="fsdp")


def theory(mesh_cfg, gathered_bytes: float, embedding_bytes: float, grad_bytes: float,
           micro_batches: int = 1) -> list[Collective]:
    """`gathered_bytes`: working parameters per device once gathered over fsdp;
    `embedding_bytes`: the table's share, which the backward does not gather again (its gradient
    is a scatter-add into the local shard); parameters are gathered once per micro-batch."""
    if mesh_cfg.fsdp == 1:
        return []
    k = micro_batches
    return [Collective("all-gather", ("fsdp",), k * gathered_bytes, what="parameters, forward"),
            Collective("all-gather", ("fsdp",), k * (gathered_bytes - embedding_bytes),
                       what="parameters but the embedding, backward"),
            Collective("reduce-scatter", ("fsdp",), grad_bytes, what="gradients")]
