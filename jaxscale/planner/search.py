"""Search: the fastest plans a mesh allows under its memory limit, by predicted step time.

What it varies (`space.py`): every layout of the devices over (dp, pp, fsdp, sp, tp) degrees
(ep with a mixture of experts) with tp and sp inside a node; ZeRO stage, gradient-sync mode
(`plan.grad_sync`), pipeline schedule and micro-batches; the memory axes remat policy,
accumulation, and (only when nothing fits without) the offload rungs; then, on the best plans,
the precision (bf16, and fp8 QAT on Hopper; the configured one on CPU or where fixed), ZeRO++
parts where weights are gathered across nodes, and the pipeline's stage layouts (balanced or
even), with ZeRO-Offload's host update and the nvme tier on offloaded plans.

How, without predicting every combination: every layout is first probed with its reference
families (`space.references`: each ZeRO stage, the default sync, 1F1B): its most frugal
point first (a layout where that does not fit is rejected whole), then its memory axes from
the cheapest point up. The `expand` layouts with the fastest probe are searched through every
family. Inside a family a point is skipped when a point that saves no more memory already fits
(it can only be slower: remat, micro-batches and offload each cost time along their axis), or
when one that saves more did not (it cannot fit). The `refine` fastest plans are then varied in
precision, ZeRO++ and stage layout. `exhaustive=True` expands every layout.

Each plan predicted is either accepted (valid and fits) or rejected with its reason: the first
validation problem (`jaxscale.plan.problems`, the same checks `train` makes), a strategy `train`
cannot run yet (`jaxscale.plan.unavailable`; `include_unavailable=True` ranks those too, marked),
or the predicted total against the device capacity (`limit` overrides it).
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field, replace

from jaxscale import plan as plan_lib
from jaxscale.plan import OPTIONS, Spec
from jaxscale.planner import memory, perf, space
from jaxscale.planner.predict import Prediction, predict, predict_spec
from jaxscale.planner.space import factorizations, place_on_nodes, sync_modes  # noqa: F401
from jaxscale.strategies.pp import stages
from jaxscale.strategies.remat import SEARCHED

REMATS = SEARCHED
EXPAND = 6          # layouts searched through every family
REFINE = 6          # plans varied in precision, ZeRO++, stage layout, offload tier


@dataclass
class Result:
    accepted: list = field(default_factory=list)     # Predictions, fastest first
    rejected: list = field(default_factory=list)     # (Spec, reason)
    layouts: int = 0            # layouts of the devices considered
    expanded: int = 0           # of them searched through every family
    pruned: int = 0             # points skipped as dominated or hopeless
    seconds: float = 0.0
    options: object = None      # the space.Options searched

    def reasons(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for _, why in self.rejected:
            key = ("does not fit in device memory" if why.startswith("needs") else
                   "not available in train yet" if "not available" in why else
                   why.split(":")[0])
            out[key] = out.get(key, 0) + 1
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def summary(self) -> str:
        return (f"{len(self.accepted)} plans fit, {len(self.rejected)} rejected; "
                f"{self.layouts} layouts probed, {self.expanded} searched through every family, "
                f"{self.pruned} dominated points skipped, in {self.seconds:.2f} s")


class _Run:
    """One search: predictions memoised by plan, each accepted or rejected once."""

    def __init__(self, limit, include_unavailable):
        self.limit, self.include_unavailable = limit, include_unavailable
        self.res, self.seen = Result(), {}

    def evaluate(self, spec: Spec):
        """(fits, Prediction | None); None when the plan is invalid."""
        key = (tuple(spec.degrees.items()), tuple(spec.dcn.items()),
               *(getattr(spec, k) for k in OPTIONS))
        if key in self.seen:
            return self.seen[key]
        errs = spec.problems()
        if not self.include_unavailable:
            errs = plan_lib.unavailable(spec) + errs
        if errs:
            self.res.rejected.append((spec, errs[0]))
            out = (False, None)
        else:
            pred = _predict(spec)
            cap = self.limit or pred.capacity
            host_cap = spec.hardware.host_bytes / (spec.n_devices if spec.device_kind == "cpu"
                                                   else 1)
            if pred.memory.total > cap:
                self.res.rejected.append((spec, f"needs {_gb(pred.memory.total)} per device > "
                                                f"{_gb(cap)}"))
                out = (False, pred)
            elif pred.memory.host_total > host_cap:
                self.res.rejected.append((spec, f"host memory: needs "
                                                f"{_gb(pred.memory.host_total)} per device > "
                                                f"{_gb(host_cap)}"))
                out = (False, pred)
            else:
                self.res.accepted.append(pred)
                out = (True, pred)
        self.seen[key] = out
        return out

    def walk(self, spec: Spec, axes: list) -> Prediction | None:
        """A family's memory axes: the most frugal point first (nothing fits if it does not),
        then from the cheapest point up, skipping dominated and hopeless points; returns the
        fastest fitting prediction."""
        def at(pt):
            upd = {}
            for axis, i in zip(axes, pt):
                upd.update(axis[i])
            return spec.with_(**upd)
        corner = tuple(len(a) - 1 for a in axes)
        fits, fails, best = [], [], None
        grid = [corner] + [pt for pt in itertools.product(*(range(len(a)) for a in axes))
                           if pt != corner]
        for pt in grid:
            if any(all(p >= f for p, f in zip(pt, q)) for q in fits) or \
                    any(all(p <= f for p, f in zip(pt, q)) for q in fails):
                self.res.pruned += 1
                continue
            ok, pred = self.evaluate(at(pt))
            if ok:
                fits.append(pt)
                best = pred if best is None or pred.time.total < best.time.total else best
            elif pred is not None:
                fails.append(pt)
            if pt == corner and not ok:
                self.res.pruned += len(grid) - 1
                break
        return best


def _predict(spec: Spec) -> Prediction:
    """`predict_spec` without validating again (the search has)."""
    mem = memory.estimate(spec)
    comms = plan_lib.collectives(spec)
    fl = perf.flops(spec)
    return Prediction(spec, mem, comms, fl, perf.step_time(spec, fl, comms, mem))


def search(cfg, n_devices: int | None = None, *, base: Spec | None = None,
           limit: float | None = None, include_unavailable: bool = False, fixed=(),
           expand: int = EXPAND, refine: int = REFINE, exhaustive: bool = False) -> Result:
    """The fastest plans for `cfg`'s model, batch and hardware on its devices (`base`: the Spec
    to start from; `limit`: device memory in bytes instead of the hardware's; `fixed`: plan keys
    of `space.FIXABLE` the user set, held at their configured values)."""
    t0 = time.perf_counter()
    base = base or Spec.from_config(cfg, n_devices)
    opts = space.options(base, fixed)
    run = _Run(limit, include_unavailable)
    prec, qat = opts.precisions[0]
    start = base.with_(precision=prec, qat=qat)
    lays = [start.with_(degrees=deg, dcn=dcn) for deg, dcn in space.layouts(start)]
    run.res.layouts = len(lays)
    for offload in ([], opts.offload):
        if offload and run.res.accepted:
            break                                   # offload only where nothing fits without
        probed = []
        for i, spec in enumerate(lays):
            found = [run.walk(_pin(spec.with_(**fam)), axes + ([offload] if offload else []))
                     for fam, axes in space.references(spec)]
            times = [p.time.total for p in found if p is not None]
            if times:
                probed.append((min(times), i, spec))
        probed.sort(key=lambda t: t[:2])
        chosen = probed if exhaustive else probed[:expand]
        run.res.expanded = len(chosen)
        for _, _, spec in chosen:
            for fam, axes in space.families(spec):
                run.walk(_pin(spec.with_(**fam)), axes + ([offload] if offload else []))
    _refine(run, opts, refine)
    res = run.res
    res.accepted = [replace(p, spec=_unpin(p.spec)) for p in res.accepted]
    res.rejected = [(_unpin(s), why) for s, why in res.rejected]
    res.accepted.sort(key=lambda p: p.time.total)
    res.options, res.seconds = opts, time.perf_counter() - t0
    return res


def _refine(run: _Run, opts, n: int) -> None:
    """The `n` fastest distinct plans, varied in precision, ZeRO++, stage layout and (offloaded
    plans) the offload tier and update."""
    seeds = sorted(run.res.accepted, key=lambda p: p.time.total)[:n]
    for pred in seeds:
        s = _unpin(pred.spec)
        for prec, qat in opts.precisions:
            v = s.with_(precision=prec, qat=qat)
            variants = [v] + [v.with_(zeropp=z) for z in space.zeropp_options(v, opts)]
            variants += [v.with_(stage_layers=c) for c in space.stage_layouts(v, opts)]
            if s.offload != "none" and s.offload_update == "device":
                variants.append(v.with_(offload_update="host"))
            if s.offload != "none" and s.offload_tier == "host" and s.offload_dir:
                variants.append(v.with_(offload_tier="nvme"))
            for var in variants:
                run.evaluate(_pin(var))


def _pin(spec: Spec) -> Spec:
    """A pipeline's `auto` stage layout as its explicit counts: the same plan, whose prediction
    then parses the counts instead of balancing the stages again at every use."""
    if spec.deg("pp") == 1 or spec.stage_layers != "auto":
        return spec
    try:
        return spec.with_(stage_layers=",".join(map(str, stages.counts(spec))))
    except ValueError:
        return spec


def _unpin(spec: Spec) -> Spec:
    """`_pin` undone: explicit counts equal to `auto`'s are `auto` again."""
    if spec.deg("pp") == 1 or spec.stage_layers == "auto":
        return spec
    auto = spec.with_(stage_layers="auto")
    return auto if _pin(auto).stage_layers == spec.stage_layers else spec


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
