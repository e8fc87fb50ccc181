"""Expert parallelism over the `ep` mesh axis, for a mixture-of-experts model (Mixtral style).

Not available in `train` yet: the planner predicts these plans and `--search` marks them.

The model (`model.moe_experts` E, `model.moe_top_k` k, `model.capacity_factor` c) replaces each
MLP with E SwiGLU experts and a linear router. Rules: `experts -> ep`; tokens stay split over
`ep` as over a data axis (the batch rule includes it). Saves: expert weights split ep ways.
Costs, in collectives per MoE layer and micro-batch: dispatch and combine all-to-alls over `ep`,
forward and backward, of tokens x k x c x dim (4 per layer); expert gradients are complete where
the experts live, so they are not reduced over `ep` (`dp.py`).
"""
from __future__ import annotations

from jaxscale.strategies.common import Comm

NAME = "ep"
AVAILABLE = False
UNAVAILABLE = ("mesh.ep={ep}, model.moe_experts={spec.model.moe_experts}: mixture-of-experts "
               "layers and expert parallelism are not available in train yet; set mesh.ep=1 and "
               "model.moe_experts=0")


def active(spec) -> bool:
    return spec.deg("ep") > 1 or spec.moe


def problems(spec) -> list[str]:
    e, E = spec.deg("ep"), spec.model.moe_experts
    if e > 1 and not E:
        return [f"mesh.ep={e} needs a mixture-of-experts model (model.moe_experts=0); set "
                f"mesh.ep=1 or model.moe_experts"]
    if E and E % e:
        return [f"model.moe_experts={E} is not divisible by mesh.ep={e}"]
    return []


def rules(spec, rules) -> None:
    if spec.deg("ep") > 1:
        rules.add("experts", "ep", by="ep")


def collectives(spec) -> list[Comm]:
    e = spec.deg("ep")
    if e == 1 or not spec.moe:
        return []
    m, k, L = spec.model, max(1, spec.accumulate), spec.stage_layers
    tokens = spec.micro_batch * spec.local_seq
    routed = tokens * m.moe_top_k * m.capacity_factor * m.dim * spec.compute_itemsize
    return [Comm("all-to-all", ("ep",), 4 * routed * L * k, int(4 * L * k),
                 "MoE dispatch and combine, forward and backward", group=e)]


def memory(spec) -> list:
    """None of its own: expert weights follow the rules; routed activations are in the layer
    table (top_k MLP activations per token)."""
    return []


def label(spec) -> list[str]:
    return []
