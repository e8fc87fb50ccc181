"""Search: every plan a mesh allows, under its memory limit, ranked by predicted step time.

Candidates: every assignment of the device count to (dp, pp, fsdp, sp, tp) degrees (ep with a
mixture of experts) whose product is the device count, with tp and sp inside one node, crossed with
ZeRO stage (when dp > 1), remat policy (none, save_dots, full), accumulation or pipeline micro-
batches, the pipeline schedule (1F1B, interleaved, ZB-H1, ZB-V), and when the data axes reduce
the gradients (`plan.grad_sync`, where the modes differ: `sync_modes`). Node boundaries follow
the mesh's outer-to-inner order: the outermost axes take the cross-node (DCN) part, as
`MeshConfig.dcn_*` would. Precision and offload stay as configured (they change numerics or need
host memory the user must grant); `does_not_fit_message` does consider them as fixes.

Each candidate is either accepted (valid and fits) or rejected with its reason: the first
validation problem (`jaxscale.plan.problems`, the same checks `train` makes), a strategy `train`
cannot run yet (`jaxscale.plan.unavailable`; `include_unavailable=True` ranks those too, marked),
or the predicted total against the device capacity.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from jaxscale import plan as plan_lib
from jaxscale.axes import MESH_AXES as AXES
from jaxscale.plan import Spec
from jaxscale.planner.predict import predict, predict_spec
from jaxscale.strategies.remat import SEARCHED

REMATS = SEARCHED


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def factorizations(n: int, axes: tuple[str, ...]) -> list[dict]:
    """All ways to write n as an ordered product over `axes`."""
    if len(axes) == 1:
        return [{axes[0]: n}]
    out = []
    for d in _divisors(n):
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


@dataclass
class Result:
    accepted: list = field(default_factory=list)     # Predictions, fastest first
    rejected: list = field(default_factory=list)     # (Spec, reason)

    def reasons(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for _, why in self.rejected:
            key = ("does not fit in device memory" if why.startswith("needs") else
                   "not available in train yet" if "not available" in why else
                   why.split(":")[0])
            out[key] = out.get(key, 0) + 1
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def candidates(base: Spec) -> list[Spec]:
    n = base.n_devices
    nodes = max(1, math.prod(base.dcn.get(a, 1) for a in AXES))
    per_node = n // nodes
    axes = tuple(a for a in AXES if a != "ep" or base.moe)
    out = []
    for deg in factorizations(n, axes):
        deg = {a: deg.get(a, 1) for a in AXES}
        if deg["tp"] * deg["sp"] > per_node and nodes > 1:
            continue                               # model-parallel axes stay inside a node
        dcn = place_on_nodes(deg, nodes) if nodes > 1 else {a: 1 for a in AXES}
        local = base.batch // max(1, deg["dp"] * deg["fsdp"] * deg["ep"])
        zeros = (0, 1, 2, 3) if deg["dp"] > 1 else (0,)
        if deg["pp"] > 1:
            micro = sorted({m for m in (deg["pp"], 2 * deg["pp"], 4 * deg["pp"])
                            if local and local % m == 0}) or [deg["pp"]]
            schedules = ("1f1b", "interleaved", "zb-h1", "zb-v")
        else:
            micro = [k for k in (1, 2, 4) if local and local % k == 0] or [1]
            schedules = ("1f1b",)
        for z in zeros:
            for remat in REMATS:
                for k in micro:
                    for sched in schedules:
                        if sched == "zb-v" and k < 2 * deg["pp"]:
                            continue               # its V needs two micro-batches per device
                        for sync in sync_modes(deg, z, k):
                            out.append(replace(
                                base, degrees=deg, dcn=dcn, zero=z, remat=remat, accumulate=k,
                                schedule=sched, grad_sync=sync,
                                virtual_stages=2 if sched == "interleaved" else 1))
    return out


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


def search(cfg, n_devices: int | None = None, *, base: Spec | None = None,
           limit: float | None = None, include_unavailable: bool = False) -> Result:
    """Enumerate, validate, predict and rank; `limit` overrides the device memory (bytes)."""
    base = base or Spec.from_config(cfg, n_devices)
    res = Result()
    for spec in candidates(base):
        errs = spec.problems()
        if not include_unavailable:
            errs = plan_lib.unavailable(spec) + errs
        if errs:
            res.rejected.append((spec, errs[0]))
            continue
        pred = predict_spec(spec)
        cap = limit or pred.capacity
        if pred.memory.total > cap:
            res.rejected.append((spec, f"needs {_gb(pred.memory.total)} per device > "
                                       f"{_gb(cap)}"))
            continue
        res.accepted.append(pred)
    res.accepted.sort(key=lambda p: p.time.total)
    return res


def _gb(x: float) -> str:
    return f"{x / 1e9:.2f} GB" if x >= 1e8 else f"{x / 2**20:.2f} MiB"


# ----------------------------------------------------------------------------- does not fit
def fixes(spec: Spec) -> list[tuple[str, dict]]:
    """Single changes to a plan: (the `--set` overrides that make it, the Spec fields it sets)."""
    out = []
    dp, fsdp, tp = spec.deg("dp"), spec.deg("fsdp"), spec.deg("tp")
    if spec.attention == "xla":
        out.append(("model.attention=auto", {"model": replace(spec.model, attention="auto")}))
    for z in range(spec.zero + 1, 4):
        if dp > 1:
            out.append((f"plan.zero={z}", {"zero": z}))
    for r in REMATS[1:]:
        if spec.remat != r:
            out.append((f"plan.remat={r}", {"remat": r}))
    if spec.accumulate > 1 and (dp > 1 or fsdp > 1):
        # the once-per-step accumulator (and held parameters) against one reduced per micro-batch
        for mode in ("auto", "microbatch"):
            if spec.grad_sync not in (mode, "microbatch") and (mode == "auto" or spec.zero < 3):
                out.append((f"plan.grad_sync={mode}", {"grad_sync": mode}))
    for k in (2, 4, 8):
        if spec.accumulate * k <= spec.local_batch:
            out.append((f"plan.accumulate={spec.accumulate * k}",
                        {"accumulate": spec.accumulate * k}))
    if dp > 1:
        out.append((f"mesh.dp=1 mesh.fsdp={fsdp * dp}",
                    {"degrees": dict(spec.degrees, dp=1, fsdp=fsdp * dp)}))
    for f in (2, 4, 8):
        if dp % f == 0 and tp * f <= spec.hardware.devices_per_node:
            out.append((f"mesh.dp={dp // f} mesh.tp={tp * f}",
                        {"degrees": dict(spec.degrees, dp=dp // f, tp=tp * f)}))
    if spec.precision == "fp32":
        out.append(("plan.precision=bf16", {"precision": "bf16"}))
    for o in ("optimizer", "optimizer+master"):
        if spec.offload != o and (spec.mixed or o == "optimizer"):
            out.append((f"plan.offload={o}", {"offload": o}))
    return out


def fitting_changes(spec: Spec, max_changes: int = 3) -> list[tuple[str, object]]:
    """The smallest sets of `fixes` (up to `max_changes` at once) after which the plan fits,
    fastest first: [(overrides, Prediction)]."""
    from itertools import combinations

    single = fixes(spec)
    for n in range(1, max_changes + 1):
        found = []
        for combo in combinations(single, n):
            fields = [f for _, upd in combo for f in upd]
            if len(fields) != len(set(fields)):
                continue
            cand = replace(spec, **{k: v for _, upd in combo for k, v in upd.items()})
            if cand.problems() or len(plan_lib.unavailable(cand)) > len(plan_lib.unavailable(spec)):
                continue
            p = predict_spec(cand)
            if p.memory.total <= p.capacity:
                found.append((" ".join(label for label, _ in combo), p))
        if found:
            return sorted(found, key=lambda f: f[1].time.total)
    return []


def does_not_fit_message(pred) -> str:
    spec, mem = pred.spec, pred.memory
    rows = sorted(mem.rows().items(), key=lambda kv: -kv[1])
    top = ", ".join(f"{k} {_gb(v)}" for k, v in rows[:3] if v > 0)
    lines = [f"the plan ({spec.label()}) does not fit: it needs {_gb(mem.total)} per device but "
             f"a {spec.device_kind} device has {_gb(pred.capacity)}. Largest consumers: {top}."]
    options = fitting_changes(spec)
    if options:
        lines.append("Cheapest changes that fit (per-device memory, predicted step time):")
        for sets, p in options[:4]:
            flags = " ".join(f"--set {s}" for s in sets.split())
            t = p.time.total
            lines.append(f"  {flags}: {_gb(p.memory.total)}, step {t:.3g} s "
                         f"({t / pred.time.total - 1:+.0%})")
    else:
        lines.append("No combination of up to three changes fits: use more devices, a smaller "
                     "batch or sequence, or run `jaxscale plan --search`.")
    return "\n".join(lines)


def check_fits(cfg, n_devices: int | None = None) -> None:
    """Raise ValueError when the plan's predicted per-device memory exceeds the device's; the
    message names the largest consumers and the cheapest changes that would make it fit."""
    pred = predict(cfg, n_devices)
    if not pred.fits:
        raise ValueError(does_not_fit_message(pred))
