"""Pipeline parallelism over the `pp` mesh axis: layers split into stages, micro-batches in flight.

Not available in `train` yet: the planner predicts these plans and `--search` marks them.

Rules: `layers -> pp`. The batch is split into m micro-batches (`plan.accumulate`), run through
the stages by a schedule (`plan.schedule`): GPipe (all forwards, then all backwards), 1F1B,
interleaved 1F1B with v virtual stages per device (`plan.virtual_stages`), ZB-H1 (the backward
split into input- and weight-gradient work, arXiv 2401.10241). Saves: weights, gradients and
optimizer state split p ways. Costs: the bubble, idle time relative to the ideal compute,
(p - 1) / m for GPipe and 1F1B, (p - 1) / (v m) interleaved, a third of 1F1B's for ZB-H1
(T_F = T_B = T_W); activations of several micro-batches in flight on a stage: m for GPipe,
min(m, p) for 1F1B and ZB-H1, min(m, p)(1 + (p - 1) / (p v)) interleaved (Korthikanti et al.,
arXiv 2205.05198, 4.2.3). Collectives: per micro-batch and virtual stage one activation of bsh
forward and its gradient backward, point to point (collective-permute over `pp`).
"""
from __future__ import annotations

from jaxscale.pipeline_schedules import NAMES
from jaxscale.strategies.common import Comm, Term

NAME = "pp"
AVAILABLE = True
SCHEDULES = NAMES


def virtual(spec) -> int:
    return spec.virtual_stages if spec.schedule == "interleaved" else 1


def in_flight(spec) -> float:
    """Micro-batches whose activations a pipeline stage holds at its peak."""
    p, m = spec.deg("pp"), max(1, spec.accumulate)
    if p == 1:
        return 1.0
    if spec.schedule == "gpipe":
        return float(m)
    base = float(min(m, p))
    if spec.schedule == "interleaved":
        return base * (1 + (p - 1) / (p * spec.virtual_stages))
    return base


def bubble_fraction(spec) -> float:
    """Pipeline idle time relative to the ideal (bubble-free) compute time."""
    p, m = spec.deg("pp"), max(1, spec.accumulate)
    if p == 1:
        return 0.0
    from jaxscale.pipeline_schedules import formula_bubble
    b = formula_bubble(spec.schedule, p, m, virtual(spec), validate=False)
    return b / (1 - b)        # idle / makespan -> idle / compute: (p - 1) / m for 1F1B


def layer_order(spec) -> list[int] | None:
    """Stored row -> model layer of the stacked layers under this plan; None for the model's
    own order. Interleaving (v > 1) stores device d's chunks c = 0..v-1 (stages c p + d) in its
    contiguous share of rows, so the layers axis can stay a plain split over pp."""
    p, v = spec.deg("pp"), virtual(spec)
    if p == 1 or v == 1:
        return None
    per = spec.model.n_layers // (p * v)
    return [(c * p + d) * per + i for d in range(p) for c in range(v) for i in range(per)]


def active(spec) -> bool:
    return spec.deg("pp") > 1


def problems(spec) -> list[str]:
    p, errs = spec.deg("pp"), []
    if p == 1:
        return errs
    from jaxscale import pipeline_schedules as ps
    try:
        ps.check(spec.schedule, p, max(1, spec.accumulate), spec.virtual_stages,
                 spec.model.n_layers)
    except ValueError as e:
        errs.append(str(e).replace("micro-batches (m)", "plan.accumulate (m)"))
    if not spec.model.scan_layers:
        errs.append("mesh.pp>1 splits the stacked layers: set model.scan_layers=true")
    for what, bad in (("sequence or context parallelism (mesh.sp>1)", spec.deg("sp") > 1),
                      ("expert parallelism (mesh.ep>1)", spec.deg("ep") > 1),
                      ("a mixture-of-experts model", spec.moe),
                      ("plan.remat=offload", spec.remat == "offload"),
                      ("host offload (plan.offload)", spec.offload != "none")):
        if bad:
            errs.append(f"mesh.pp={p} with {what} is not supported yet: set mesh.pp=1, or drop "
                        f"{what.split(' (')[0]}")
    return errs


def rules(spec, rules) -> None:
    if active(spec):
        rules.add("layers", "pp", by="pp")


def collectives(spec) -> list[Comm]:
    p = spec.deg("pp")
    if p == 1:
        return []
    k, v = max(1, spec.accumulate), virtual(spec)
    act = spec.micro_batch * spec.local_seq * spec.model.dim * spec.compute_itemsize / (
        spec.deg("tp") if spec.sequence_parallel else 1)
    return [Comm("collective-permute", ("pp",), 2 * k * v * act, 2 * k * v,
                 "stage boundary: activations forward, their gradients backward", group=p,
                 overlap=True)]


def memory(spec) -> list[Term]:
    """The activations of the other micro-batches in flight on the busiest stage."""
    extra = in_flight(spec) - 1
    if not extra:
        return []
    from jaxscale.planner.activations import of_spec
    la = of_spec(spec)
    out = [Term("activations", la.saved * spec.stage_layers * extra,
                f"{in_flight(spec):g} micro-batches in flight ({spec.schedule})")]
    if la.host:
        out.append(Term("host", la.host * spec.stage_layers * extra,
                        "offloaded activations of the other micro-batches", part="activations"))
    return out


def label(spec) -> list[str]:
    if not active(spec):
        return []
    return [spec.schedule + (f"/v{spec.virtual_stages}" if spec.schedule == "interleaved" else "")]
