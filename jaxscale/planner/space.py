"""What the search varies: layouts of the devices, the options crossed with them, and the order
in which each option trades memory for time.

A *layout* is an assignment of the device count to the mesh axes' degrees (tp and sp inside a
node; the outermost axes take the cross-node part, as `MeshConfig.dcn_*` would). A *family* is
a layout with the options that trade time against time (ZeRO stage, gradient-sync mode,
pipeline schedule and micro-batches); inside a family the *memory axes* each save memory at a
cost in time, monotone along the axis: the remat policy (none, save_dots, full), the micro-batches
without a pipeline (1, 2, 4), and the offload rungs (`OFFLOAD`, tried only when nothing fits
without them). The search walks a family's memory axes from the cheapest point and skips every
point another fitting point dominates (`search.py`).

The precisions (`options`): on a GPU bf16 with fp32 master weights, and where the device has
fp8 matrix units (`Hardware.peak_fp8`) fp8 quantisation-aware training (`plan.qat=fp8`) beside
it; on CPU, or where the user fixed it, the configured one. ZeRO++ parts (`zeropp_options`)
where weights are gathered across nodes; pipeline stage layouts (`stage_layouts`): the balanced
`auto` (uneven where the embedding and the head make the edge stages costlier) and the even
split.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from jaxscale.axes import MESH_AXES as AXES
from jaxscale.strategies import zeropp as zeropp_lib
from jaxscale.strategies.pp import stages
from jaxscale.strategies.remat import SEARCHED as REMATS
from jaxscale.strategies.zero import gather_axes

#: pipeline schedules tried with mesh.pp > 1
SCHEDULES = ("1f1b", "interleaved", "zb-h1", "zb-v")
#: ZeRO++ combinations tried where weights are gathered across nodes (invalid ones dropped)
ZEROPP = ("qwz", "qgz", "qwz+qgz", "all")
#: the plan.* keys `search(fixed=...)` can hold at their configured values
FIXABLE = ("precision", "qat", "zeropp", "offload", "stage_layers")


@dataclass(frozen=True)
class Options:
    """The choices the search crosses with every layout, beyond the memory axes."""
    precisions: tuple = (("fp32", "none"),)      # (plan.precision, plan.qat), default first
    zeropp: bool = True                          # try ZeRO++ parts where they apply
    stage_layouts: bool = True                   # try the even split beside auto
    offload: tuple = ()                          # the offload rungs, least offloaded first

    def describe(self) -> str:
        prec = ", ".join(p if q == "none" else f"{p}+{q} QAT" for p, q in self.precisions)
        rungs = ", ".join(o["offload"] for o in self.offload)
        return (f"precision {prec}; "
                + ("ZeRO++ where weights are gathered across nodes; " if self.zeropp else "")
                + ("pipeline stages balanced and even; " if self.stage_layouts else "")
                + (f"offload {rungs} only if nothing fits without" if rungs else
                   "offload as configured"))


def options(base, fixed=()) -> Options:
    """The `Options` for `base` (a Spec): `fixed` names `FIXABLE` keys the user set."""
    fixed = set(fixed)
    gpu = base.device_kind != "cpu"
    prec = "bf16" if gpu and base.precision == "fp32" and "precision" not in fixed \
        else base.precision
    precisions = [(prec, base.qat)]
    if gpu and prec != "fp32" and base.qat == "none" and "qat" not in fixed \
            and base.hardware.peak_fp8 > 0:
        precisions.append((prec, "fp8"))
    mixed = prec != "fp32"
    offload = []
    if "offload" not in fixed and base.offload == "none":
        rungs = ["optimizer", "optimizer+master", "optimizer+master+params"] if mixed else \
            ["optimizer", "optimizer+params"]
        offload = [{"offload": r} for r in rungs]
    return Options(tuple(precisions), "zeropp" not in fixed and base.zeropp == "none",
                   "stage_layers" not in fixed and base.stage_layers == "auto",
                   tuple(offload))


# ----------------------------------------------------------------------------- layouts
def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def factorizations(n: int, axes: tuple[str, ...]) -> list[dict]:
    """All ways to write n as an ordered product over `axes`."""
    if len(axes) == 1:
        return [{axes[0]: n}]
    out = []
    for d in divisors(n):
        for rest in factorizations(n // d, axes[1:]):
            out.append({axes[0]: d, **rest})
    return out


def place_on_nodes(degrees: dict, nodes: int) -> dict:
    """dcn degrees: the outermost axes absorb the node count first."""
    dcn, left = {}, nodes
    for a in AXES:
        g = math.gcd(left, degrees.get(a, 1))
        dcn[a] = g
        left //= g
    return dcn


def nodes_of(base) -> int:
    return max(1, math.prod(base.dcn.get(a, 1) for a in AXES))


def layouts(base) -> list[tuple[dict, dict]]:
    """(degrees, dcn) of every layout of `base`'s devices: tp and sp inside a node."""
    n, nodes = base.n_devices, nodes_of(base)
    per_node = n // nodes
    axes = tuple(a for a in AXES if a != "ep" or base.moe)
    out = []
    for deg in factorizations(n, axes):
        deg = {a: deg.get(a, 1) for a in AXES}
        if deg["tp"] * deg["sp"] > per_node and nodes > 1:
            continue                               # model-parallel axes stay inside a node
        out.append((deg, place_on_nodes(deg, nodes) if nodes > 1 else {a: 1 for a in AXES}))
    return out


# ----------------------------------------------------------------------------- families
def zeros(spec) -> tuple[int, ...]:
    """ZeRO stages over dp. Stage 3 over dp is FSDP over dp (the layout with those devices on
    fsdp is searched too), so it is tried only where it differs: dp wholly across nodes beside
    fsdp inside (the hybrid layout ZeRO++'s hpZ needs)."""
    dp, fsdp = spec.deg("dp"), spec.deg("fsdp")
    if dp == 1:
        return (0,)
    hybrid = fsdp > 1 and spec.dcn.get("dp", 1) == dp
    return (0, 1, 2, 3) if hybrid else (0, 1, 2)


def sync_modes(deg: dict, zero: int, k: int) -> tuple[str, ...]:
    """The gradient-sync modes that make different programs (`strategies.dp`): with one
    micro-batch, one; `step` where an axis splits the parameters (fsdp, ZeRO-3's dp: more
    memory, fewer bytes); `microbatch` where a replicated dp axis would be reduced once (a
    sharded accumulator under ZeRO-2: less memory, more bytes)."""
    if k == 1:
        return ("auto",)
    out = ["auto"]
    if deg["fsdp"] > 1 or (zero >= 3 and deg["dp"] > 1):
        out.append("step")
    if deg["dp"] > 1 and zero < 3:
        out.append("microbatch")
    return tuple(out)


def families(spec) -> list[tuple[dict, list]]:
    """(the family's option values, its memory axes) for a layout's `spec`; each memory axis is
    a list of option updates, least memory saved (fastest) first."""
    deg, local = spec.degrees, spec.local_batch
    local = int(local) if local == int(local) else 0
    remat = [{"remat": r} for r in REMATS]
    out = []
    if deg["pp"] > 1:
        p = deg["pp"]
        micro = sorted({m for m in (p, 2 * p, 4 * p) if local and local % m == 0}) or [p]
        for z in zeros(spec):
            for sched in SCHEDULES:
                for m in micro:
                    if sched == "zb-v" and m < 2 * p:
                        continue                   # its V needs two micro-batches per device
                    for sync in sync_modes(deg, z, m):
                        out.append(({"zero": z, "schedule": sched, "accumulate": m,
                                     "grad_sync": sync,
                                     "virtual_stages": 2 if sched == "interleaved" else 1},
                                    [remat]))
        return out
    micro = [k for k in (1, 2, 4) if local and local % k == 0] or [1]
    for z in zeros(spec):
        for sync in dict.fromkeys(s for k in micro for s in sync_modes(deg, z, k)):
            ks = [{"accumulate": k} for k in micro if sync in sync_modes(deg, z, k)]
            out.append(({"zero": z, "grad_sync": sync, "schedule": "1f1b",
                         "virtual_stages": 1}, [remat, ks]))
    return out


def references(spec) -> list[tuple[dict, list]]:
    """The families a layout is first probed and ranked by: each ZeRO stage with the default
    sync, a pipeline's 1F1B at the most micro-batches (the stages differ in time by up to a
    third where dp crosses nodes, so none stands for the others)."""
    fams = [(f, ax) for f, ax in families(spec) if f["grad_sync"] == "auto"
            and f["schedule"] == "1f1b"]
    most = max(f.get("accumulate", 1) for f, _ in fams)
    return [(f, ax) for f, ax in fams if f.get("accumulate", 1) == most]


# ----------------------------------------------------------------------------- refinements
def zeropp_options(spec, opts: Options) -> list[str]:
    """ZeRO++ values worth trying on `spec`: where its weights are gathered across nodes."""
    if not opts.zeropp or spec.zeropp != "none":
        return []
    axes = gather_axes(spec)
    if not axes or spec.deg("fsdp") == 1 or not spec.cross_node(axes):
        return []
    out = []
    for z in ZEROPP:
        if not zeropp_lib.problems(spec.with_(zeropp=z)):
            out.append(z)
    return out


def stage_layouts(spec, opts: Options) -> list[str]:
    """The even split of the layers over the pipeline stages, where it differs from `auto`."""
    if not opts.stage_layouts or spec.deg("pp") == 1 or spec.stage_layers != "auto":
        return []
    try:
        auto = stages.counts(spec)
    except ValueError:
        return []
    even = stages.even(spec.model.n_layers, stages.n_stages(spec))
    return [",".join(map(str, even))] if even != auto else []
