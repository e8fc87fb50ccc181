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

from jaxscale.strategies.common import Comm, Term

NAME = "pp"
AVAILABLE = False
UNAVAILABLE = ("mesh.pp={pp}: pipeline parallelism is not available yet; set mesh.pp=1 and give "
               "the devices to dp, fsdp or tp")
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")


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


def active(spec) -> bool:
    return spec.deg("pp") > 1


def problems(spec) -> list[str]:
    p, errs = spec.deg("pp"), []
    if p == 1:
        return errs
    if spec.schedule not in SCHEDULES:
        errs.append(f"plan.schedule={spec.schedule!r}: valid are {', '.join(SCHEDULES)}")
    if spec.virtual_stages < 1:
        errs.append(f"plan.virtual_stages={spec.virtual_stages} must be >= 1")
    stages = p * virtual(spec)
    if spec.model.n_layers < stages:
        errs.append(f"model.n_layers={spec.model.n_layers} is fewer than the {stages} pipeline "
                    f"stages (pp={p}" + (f" x virtual={virtual(spec)}" if stages != p else "")
                    + ")")
    if spec.schedule == "interleaved" and spec.accumulate % p:
        errs.append(f"the interleaved schedule needs the micro-batch count (plan.accumulate="
                    f"{spec.accumulate}) to be a multiple of pp={p}")
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
