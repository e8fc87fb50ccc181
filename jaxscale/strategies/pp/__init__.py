"""Pipeline parallelism over the `pp` mesh axis: layers split into stages, micro-batches in flight.

Rules: `layers -> pp`. The batch is split into m micro-batches (`plan.accumulate`), run through
the stages by a schedule (`plan.schedule`, `jaxscale.strategies.pp.schedules`): naive (one
micro-batch at a time), GPipe (all forwards, then all backwards), 1F1B, interleaved 1F1B with v
virtual stages per device (`plan.virtual_stages`), ZB-H1 and ZB-V (the backward split into input-
and weight-gradient work, arXiv 2401.10241; ZB-V with two stages per device placed in a V). The
stages may differ in length (`plan.stage_layers`, `stages.py`); the tick table a schedule runs
as is `program.py`, the engine that runs it `engine.py`, a stage's ops `stage.py`. Inside a
stage every other strategy runs as in the unpipelined step (dp, fsdp, tp, context parallelism,
experts over ep, QAT, collective matmul, offload, remat).
Saves: weights, gradients and optimizer state split p ways. Costs: the bubble, idle time
relative to the ideal compute, (p - 1) / m for GPipe and 1F1B, (p - 1) / (v m) interleaved, a
third of 1F1B's for ZB-H1 and a sixth for ZB-V (T_F = T_B = T_W; W computes only the weight
gradients, from a tape of matmul inputs and output gradients B keeps: 1F1B's FLOPs);
activations of several micro-batches in flight on a device (the engine's residual slots: m for
GPipe, p for 1F1B), and the split schedules' tapes. Collectives: per tick of the engine one
activation forward and one gradient backward, point to point (collective-permute over `pp`; one
ring carries both at p = 2); one fp32 all-reduce over `pp` of the embedding, final norm and head
gradients.
"""
from __future__ import annotations

from jaxscale.strategies import common, precision, remat, zero
from jaxscale.strategies.common import Comm, Term
from jaxscale.strategies.pp import schedules as ps
from jaxscale.strategies.pp import stages
from jaxscale.strategies.pp.program import program_for
from jaxscale.strategies.tables import activations as act_table
from jaxscale.strategies.tables.activations import stream_bytes
from jaxscale.strategies.tables.params import leaves

NAME = "pp"
AVAILABLE = True
SCHEDULES = ps.NAMES


def chunks(spec) -> int:
    """Stages per device: `plan.virtual_stages` interleaved, 2 for ZB-V, else 1."""
    return ps.chunks(spec.schedule, spec.virtual_stages)


def in_flight(spec) -> float:
    """Micro-batches whose activations (residuals) a device holds at its peak, in units of its
    whole share of the layers: the engine's residual slots (`program.Program`) over v."""
    if spec.deg("pp") == 1:
        return 1.0
    return program_for(spec).slots["res"] / chunks(spec)


def bubble_fraction(spec) -> float:
    """Pipeline idle time relative to the ideal (bubble-free) compute time."""
    p, m = spec.deg("pp"), max(1, spec.accumulate)
    if p == 1:
        return 0.0
    b = ps.formula_bubble(spec.schedule, p, m, chunks(spec), validate=False)
    return b / (1 - b)        # idle / makespan -> idle / compute: (p - 1) / m for 1F1B


def active(spec) -> bool:
    return spec.deg("pp") > 1


def problems(spec) -> list[str]:
    """What no pipeline can run: an invalid schedule for (p, m, v), a stage layout that is no
    split of the layers."""
    p, errs = spec.deg("pp"), []
    if p > 1:
        try:
            ps.check(spec.schedule, p, max(1, spec.accumulate), spec.virtual_stages)
        except ValueError as e:
            errs.append(str(e).replace("micro-batches (m)", "plan.accumulate (m)"))
    return errs + stages.problems(spec)


def runnable(spec) -> list[str]:
    """What the engine (`engine.py`) cannot run, though the planner models it."""
    p, errs = spec.deg("pp"), []
    if p == 1:
        return errs
    if not spec.model.scan_layers:
        errs.append("mesh.pp>1 splits the stacked layers: set model.scan_layers=true")
    return errs


def boundary_bytes(spec) -> float:
    """One stage-boundary activation (or its gradient) per device: the residual stream of a
    micro-batch, split over tp too under Megatron sequence parallelism (its `norm_seq`)."""
    return stream_bytes(spec) / (spec.deg("tp") if spec.sequence_parallel else 1)


def rules(spec, rules) -> None:
    if active(spec):
        rules.add("layers", "pp", by="pp")


def collectives(spec) -> list[Comm]:
    """Per tick of the engine's loop (`engine.py`), one activation forward and one gradient
    backward (sent in every tick, zeros when a device has nothing to send); at the end, the
    gradients of the weights outside the layers (embedding, final norm, head: replicated over pp,
    each used on one stage) summed over pp in fp32."""
    p = spec.deg("pp")
    if p == 1:
        return []
    prog = program_for(spec)
    act = boundary_bytes(spec)
    # inside the data region the axes it reduces once per step hold the outer leaves whole
    whole = common.sync_axes(spec)
    outer = sum(zero.stored_size(spec, leaf, drop=whole) * 4 for leaf in leaves(spec.model)
                if not leaf.stacked)
    rings = " and ".join(k for k, r in prog.rings.items() if r)
    return [Comm("collective-permute", ("pp",), prog.permutes * act, prog.permutes,
                 f"stage boundary, {prog.ticks} ticks on the {rings} ring: activations "
                 f"forward, their gradients backward ({prog.useful_sends} of the sends carry "
                 f"data)", group=p, overlap=True, minimum=prog.useful_sends * act),
            Comm("all-reduce", ("pp",), outer, 1, "gradients of the embedding, final norm and "
                 "head (fp32), from the stages that use them", group=p)]


def branch_share(spec) -> list[float]:
    """A device runs one pipeline op per tick, not all of them: the share of (tick, device) slots
    each branch of the engine's switch takes (`program.Program.branch_share`)."""
    return program_for(spec).branch_share()


def memory(spec) -> list[Term]:
    """Beyond the one micro-batch's activations the model counts: the residuals of the other
    micro-batches in flight, plus the one just computed (a stage's forward returns it out of the
    engine's switch before it is written to its slot); and the stage-boundary slots (activations
    received, gradients received or to send), one [micro-batch, seq, dim] each. The slots hold
    the compute dtype as stored: XLA:CPU widens bf16 arithmetic to f32, not these buffers (bf16
    on dp2 x pp2 x tp2: 0.70 MB of ZB-H1's slots and tape, half what f32 would hold); the
    residuals the table keeps in fp32 (the attention scores, the statistics) stay fp32 there:
    with 12 heads over a sequence of 96 the scores are 70% of a layer's residuals, so a bf16
    1F1B step holds 85% of fp32's slots, not half (dp4 x pp2 with the direct fusion emitter:
    36.1 MB compiled against fp32's 39.6). The micro-batch being computed is one of the slots'
    values too (`remat.held`, for both): of 23 generated 16-bit pipelines, 19 are
    then within 15% of the temp XLA:CPU compiles with its default flags, against 15 with every
    slot halved and the micro-batch at f32 width. Short are pipelines of two-layer stages, where
    the default fusions also keep f32 copies of residuals the backward converts (the same
    1F1B: 41.5 MB in bf16, more than fp32; 0.84 of it)."""
    if spec.deg("pp") == 1:
        return []
    slots, v, la = program_for(spec).slots, chunks(spec), remat.activations(spec)
    extra = (slots["res"] + 1) / v - 1
    stored = remat.held(spec).saved
    as_stored = precision.compute_itemsize(spec) / spec.compute_itemsize
    stream = boundary_bytes(spec) * precision.compute_itemsize(spec) / spec.wire_compute_itemsize
    out = [Term("activations", stored * spec.stored_layers * extra,
                f"residuals of {in_flight(spec):g} micro-batches in flight ({spec.schedule}) "
                f"and of the one being stored"),
           Term("activations", stream * (slots["act"] + slots["grad"]),
                "stage-boundary slots: activations and gradients received")]
    if la.host:      # the remat policy's offloaded residuals wait in host-memory slots
        held = la.host * spec.stored_layers * (slots["res"] + 1) / v
        out.append(Term("activations", held, "offloaded residuals' slots in host memory (XLA:CPU's "
                        "memory analysis counts them as temporaries)")
                   if spec.device_kind == "cpu" else
                   Term("host", held - la.host * spec.stored_layers,
                        "offloaded residuals of the micro-batches in flight", part="activations"))
    out += uneven(spec, stored)
    if spec.schedule in ps.SPLIT:
        out.append(Term("activations", tape_bytes(spec) * as_stored * spec.stored_layers / v
                        * (slots["tape"] + 1), f"tape slots: the matmul inputs and output "
                        f"gradients B keeps for W ({slots['tape']}, and the one being stored)"))
    return out


def uneven(spec, residual: float) -> list[Term]:
    """A stage that runs its layer loop over a slice of the rows its device stores: a shorter
    stage (its chunk's rows less the padding), or any stage of a device holding several
    (interleaved, ZB-V: each chunk's rows of the device's stack). Its branch copies its rows of
    the stacked weights (F and B each take one, a split schedule's W not), and where stages are
    padded it returns its n layers' residuals (`residual`: one layer's for one micro-batch)
    apart from the slot they are written into. Measured on dp4 x pp2, 1F1B, stages of (2, 3)
    and (3, 4) layers, remat none and full: the compiled temp exceeds the even stack's (3, 3)
    and (4, 4) by these within 0.2%. dp2 x pp2 x fsdp2 interleaved v = 2, 2 rows a chunk: by
    9.62 MB with padded chunks (5, 6 or 7 layers) where this says 9.58 (the planner was at
    0.84 of the compiled temp without it), by 2.24 MB on 8 layers where the copies are 1.54.
    A one-layer stage's loop is inlined: no slice, no copy."""
    counts, rows = set(stages.counts(spec)), stages.rows(spec)
    several = chunks(spec) > 1
    n = max((k for k in counts if k >= 2 and (several or k < rows)), default=0)
    if not n:
        return []
    copies = 1 if spec.schedule in ps.SPLIT else 2
    padded = min(counts) < rows
    return [Term("backward", n * (copies * zero.stored_layer_bytes(spec) + padded * residual),
                 f"a {n}-layer stage's sliced weights" + (
                     f" and its residuals apart from its {rows}-layer slot" if padded else ""))]


def tape_bytes(spec) -> float:
    """One layer's tape for one micro-batch per device: each weight matmul's input (once per
    group reading it) and output gradient, a mixture of experts' MLP not among them."""
    tags = [t for t in (*act_table.MATMUL_INPUTS, *act_table.MATMUL_TAGS)
            if not (spec.moe and t.startswith("mlp_"))]
    return sum(act_table.tag_bytes(spec.model, t, spec.micro_batch * spec.seq,
                                   spec.compute_itemsize, act_table.split(spec)) for t in tags)


def label(spec) -> list[str]:
    if not active(spec):
        return []
    return [spec.schedule + (f"/v{spec.virtual_stages}" if spec.schedule == "interleaved" else "")]


def shape_step(spec, parts) -> None:
    """The step: the gradients computed by the schedule over the stages (`engine.make_grads_fn`),
    the stacked layers stored in the stages' padded order (`stages.layer_order`)."""
    if active(spec):
        parts.set("grads", _engine, by=NAME)
        parts.set("layer_order", stages.layer_order(spec), by=NAME)


def _engine(model, placement, parts, forward_only: bool = False):
    from jaxscale.strategies.pp.engine import make_grads_fn
    return make_grads_fn(model, placement, parts, forward_only)
