"""Generated layouts: a plan of 3 to 6 composition options on 8 devices and a model shape no test
was written for, drawn from a seed, and the one check every such case must pass.

`draw(seed)` picks options from `composition.OPTIONS` (at most one of each exclusive group: one
pipeline schedule, one context method, one 16-bit precision, ...), mesh degrees (each option's
axis at 2, sometimes 4; dp takes the devices left) and a shape: odd widths, a kv-head ratio, 2 to
5 layers, an odd vocabulary, a sequence length the plan allows. The shape obeys only what no
implementation could avoid (`SHAPE_RULES`: tp splits whole heads, the experts split evenly over
ep, a pipeline stage holds at least one layer, ...); everything else the plan must run, and a
refusal other than the composition table's principled ones (`composition.REASONS`) is a failure.

`check(case)` runs the case as the tests prove a strategy (`tests/README.md`):
1. numerics: 3 real AdamW updates against a reference (`reference`: one device with the options
   that change the arithmetic; local SGD's replicas of one device each), within the tolerance
   the options' methods allow (`tolerance`: their error bounds summed), each later update's
   gradients against the reference's at the plan's own weights (`harness.at_weights`);
2. the census row by row against the plan's formulas, compiled temp and argument memory against
   the planner, matmul FLOPs against the formula (`validation.compare`'s tolerances).
A failure names its class and the `jaxscale train` line that reproduces it.
"""
from __future__ import annotations

import dataclasses
import math
import random
import traceback
from dataclasses import dataclass, field

from jaxscale.analysis import composition

#: options of which a plan takes at most one
EXCLUSIVE = [set(composition.PIPELINE), {"ring", "Ulysses"}, {"bf16", "fp16"},
             {"QAT fp8", "QAT int8"}, {"int8 compression", "PowerSGD"},
             {"DiLoCo", "Streaming DiLoCo"}, {"ZeRO-1", "ZeRO-3"}, {"MoE", "ep"}]
#: what every drawn shape obeys: requirements no implementation avoids
SHAPE_RULES = ("tp splits whole query and kv heads", "ep splits the experts evenly",
               "each pipeline stage (and virtual stage) holds a layer",
               "context parallelism's zig-zag cuts the sequence into 2 x sp equal chunks",
               "the global batch divides into data shards x micro-batches",
               "rotary embeddings rotate pairs: an even head dimension")
LOCAL_SGD = {"DiLoCo", "Streaming DiLoCo"}
#: options that work on dp's replicas: a plan with them keeps dp >= 2
NEEDS_DP = LOCAL_SGD | {"int8 compression", "PowerSGD", "sparse embedding", "ZeRO-1", "ZeRO-3"}
#: the width, feed-forward and vocabulary sizes drawn from (none a power of two but 64)
DIMS, FFNS, VOCABS, SEQS = (64, 96, 160), (160, 224, 288), (301, 419, 509), (32, 48, 64, 96)


@dataclass(frozen=True)
class Case:
    seed: int
    options: tuple[str, ...]
    mesh: tuple[tuple[str, int], ...]
    shape: tuple[tuple[str, int], ...]          # model.* and data.* settings

    def overrides(self) -> tuple[str, ...]:
        return _with(composition.overrides(*self.options), self.mesh, self.shape)

    def command(self) -> str:
        """The `jaxscale train` line that runs this case."""
        return "jaxscale train llama_tiny --steps 3 " + " ".join(
            f"--set {o}" for o in (*self.overrides(), "optim.warmup_steps=0")
            if o != "plan.check_memory=false")

    def label(self) -> str:
        mesh = "x".join(f"{a}{d}" for a, d in self.mesh if d > 1) or "1"
        return f"{mesh} {' + '.join(self.options)}"


def _options(rng: random.Random) -> list[str]:
    target, out = rng.randint(3, 6), []
    for name in rng.sample(list(composition.OPTIONS), len(composition.OPTIONS)):
        if any(name in g and g & set(out) for g in EXCLUSIVE):
            continue
        out.append(name)
        if len(out) == target:
            break
    return out


def _mesh(rng: random.Random, options) -> dict[str, int]:
    degrees: dict[str, int] = {}
    for name in options:
        for axis, d in composition.OPTIONS[name][0].items():
            degrees[axis] = max(degrees.get(axis, 1), d)
    room = 2 if NEEDS_DP & set(options) else 1       # devices dp keeps
    if rng.random() < 0.5 and math.prod(degrees.values()) * room <= 4 and "fsdp" not in degrees:
        degrees["fsdp"] = 2                     # a data axis beside dp, now and then
    for axis in rng.sample(sorted(degrees), len(degrees)):
        if axis not in ("pp", "sp") and rng.random() < 0.3 and \
                math.prod(degrees.values()) * room <= 4:
            degrees[axis] *= 2                  # one axis at 4 now and then
    used = math.prod(degrees.values())
    return {"dp": 8 // used if used <= 8 else 0, "pp": 1, "fsdp": 1, "ep": 1, "sp": 1, "tp": 1,
            **degrees}


def _shape(rng: random.Random, mesh, extra: dict) -> dict[str, int]:
    tp, sp, pp = mesh["tp"], mesh["sp"], mesh["pp"]
    hd = rng.choice((8, 16))
    dim = rng.choice([d for d in DIMS if d % (hd * tp) == 0] or [hd * tp * 4])
    heads = dim // hd
    kv = rng.choice([k for k in range(1, heads + 1) if heads % k == 0 and k % tp == 0])
    stages = pp * chunks(extra)
    layers = rng.randint(max(2, stages), max(5, stages))
    seq = rng.choice([s for s in SEQS if s % (2 * sp) == 0])
    acc = int(extra.get("plan.accumulate", 1))
    shards = mesh["dp"] * mesh["fsdp"] * mesh["ep"]
    out = {"model.dim": dim, "model.n_heads": heads, "model.n_kv_heads": kv,
           "model.ffn_dim": rng.choice(FFNS), "model.n_layers": layers,
           "model.vocab_size": rng.choice(VOCABS), "data.seq_len": seq,
           "data.batch_size": shards * acc * rng.choice((1, 2))}
    if "model.moe_experts" in extra:
        out["model.moe_experts"] = mesh["ep"] * rng.choice((2, 4)) if mesh["ep"] > 1 else 4
    return out


def chunks(settings: dict) -> int:
    """Virtual stages per pipeline device of a case's plan settings (`schedules.chunks`)."""
    from jaxscale.strategies.pp.schedules import chunks as of
    return of(settings.get("plan.schedule", "1f1b"), int(settings.get("plan.virtual_stages", 1)))


def draw(seed: int) -> Case:
    """The case of `seed`: options whose pairs the table does not refuse for one of its
    principled reasons, a mesh and a shape (see the module docstring)."""
    rng = random.Random(seed)
    while True:
        options = _options(rng)
        if any(composition.reason(composition.pair(a, b)) for i, a in enumerate(options)
               for b in options[i + 1:]):
            continue                            # a pair no implementation could run: redraw
        mesh = _mesh(rng, options)
        if mesh["dp"] < (2 if NEEDS_DP & set(options) else 1):
            continue                            # more mesh axes than 8 devices hold: redraw
        extra = dict(o.split("=", 1) for o in composition.overrides(*options)
                     if not o.startswith("mesh."))
        shape = _shape(rng, mesh, extra)
        return Case(seed, tuple(options), tuple(mesh.items()), tuple(shape.items()))


# ----------------------------------------------------------------------------- the check
#: options whose strategy exists only on a mesh: the reference runs without them
LAYOUT_ONLY = {"fsdp", "ZeRO-1", "ZeRO-3", "tp", "Megatron SP", "ring", "Ulysses", "ep",
               "pp 1F1B", "pp ZB-H1", "pp interleaved", "pp ZB-V", "optimizer offload",
               "collective matmul", "ZeRO++ qwZ+qgZ", "sparse embedding", "int8 compression",
               "PowerSGD", "full remat"}


def reference(case: Case) -> tuple[tuple[str, ...], int]:
    """(the reference's overrides, its device count): one device with the options that change
    the arithmetic (precision, QAT, pruning, the mixture of experts, the micro-batches); with
    local SGD, dp replicas of one device each, averaged with the case's compression. The
    micro-batches are the case's wherever they come from (a pipeline's too): a mixture's balance
    loss is a micro-batch's."""
    opts = [o for o in case.options if o not in LAYOUT_ONLY or
            (LOCAL_SGD & set(case.options) and o in ("int8 compression", "PowerSGD"))]
    if "ep" in case.options:
        opts.append("MoE")
    dp = dict(case.mesh)["dp"] if LOCAL_SGD & set(case.options) else 1
    mesh = (("dp", dp), ("pp", 1), ("fsdp", 1), ("ep", 1), ("sp", 1), ("tp", 1))
    micro = [o for o in case.overrides() if o.startswith("plan.accumulate=")]
    return (*_with(composition.overrides(*opts), mesh, case.shape), *micro[-1:]), dp


def _with(base, mesh, shape) -> tuple[str, ...]:
    """The options' overrides with the mesh and the shape in place of theirs."""
    shape = dict(shape)
    keep = [o for o in base if not o.startswith("mesh.") and o.split("=")[0] not in shape
            and not o.startswith("model.n_kv")]
    return (*keep, *(f"mesh.{a}={d}" for a, d in mesh), *(f"{k}={v}" for k, v in shape.items()))


def tolerance(case: Case):
    """The error the case's methods allow against the reference: each method's bound
    (`harness`' tolerances) summed over the methods present (independent roundings add)."""
    from jaxscale.analysis import harness as N
    parts = [fp32(case)]
    table = {"bf16": N.BF16, "fp16": N.BF16, "QAT int8": N.QAT_INT8, "QAT fp8": N.QAT_FP8,
             "MoE": N.MOE, "ep": N.MOE, "int8 compression": N.COMPRESSION["int8"],
             "PowerSGD": N.COMPRESSION["powersgd"], "2:4 pruning": N.PRUNED,
             "ZeRO++ qwZ+qgZ": N.ZEROPP["qwz+qgz"]}
    if {"bf16", "fp16"} & set(case.options):
        table["QAT fp8"] = N.QAT_FP8_16BIT
    parts += [table[o] for o in case.options if o in table]
    if LOCAL_SGD & set(case.options):
        parts.append(dataclasses.replace(N.FP32, grads=None))  # its own step shows none
    return N.combine(parts)


def fp32(case: Case):
    """FP32's bound for the case: its gradients' sums split over each data, model and pipeline
    axis the mesh has and over its micro-batches, each split summed in its own order; the
    rounding of each reordered sum adds (a few ulps of the partial sums each), so the gradient
    bound grows with their number, FP32's 1e-5 for up to two (dp2 x pp2 x tp2 with micro-batches,
    four: 1.2-1.7e-5 measured; a dropped or doubled reduction is off by O(1))."""
    from jaxscale.analysis import harness as N
    from jaxscale.analysis import validation
    mesh = dict(case.mesh)
    sums = sum(mesh.get(a, 1) > 1 for a in ("dp", "fsdp", "ep", "sp", "tp", "pp"))
    sums += validation.tiny_config(*case.overrides()).plan.accumulate > 1
    return dataclasses.replace(N.FP32, grads=N.FP32.grads * max(1.0, sums / 2))


@dataclass
class Result:
    case: Case
    ok: bool = False
    failure: str = ""                   # the class: refused, numerics, census, memory, ...
    detail: str = ""
    numerics: dict = field(default_factory=dict)
    worst_collective: float = 0.0       # |census / formula - 1| at worst
    temp: float | None = None           # planner / compiled
    flops: float | None = None


def check(case: Case) -> Result:
    """Validate, compile and run `case`; the first failing class is the result's."""
    import jax

    from jaxscale import plan, planner
    from jaxscale.analysis import harness, inspect, validation
    res = Result(case)
    cfg = validation.tiny_config(*case.overrides())
    try:
        plan.validate(cfg, 8)
    except ValueError as e:
        res.failure, res.detail = "refused", str(e).splitlines()[-1].strip(" -")
        return res
    try:
        steps = harness.STEPS
        if LOCAL_SGD & set(case.options):      # past the first average (the anchor's move)
            steps = max(steps, cfg.plan.local_steps + cfg.plan.outer_delay + 1)
        got = harness.run(case.overrides(), steps=steps)
        ref_ov, n = reference(case)
        ref = harness.run(ref_ov, jax.devices()[:n], steps=steps)
        bad, res.numerics = harness.problems(got, ref, tolerance(case).over(steps),
                                             same_weights=True)
        cmp = validation.compare(planner.predict(cfg), inspect.report(cfg))
    except Exception as e:      # noqa: BLE001 - a case that does not build is a result too
        res.failure = "error"
        res.detail = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        res.detail += " @ " + traceback.extract_tb(e.__traceback__)[-1].name
        return res
    rows = {r["what"]: r["ratio"] for r in cmp["memory"]}
    res.temp, res.flops = rows.get("temp"), rows.get("flops")
    res.worst_collective = cmp["worst_collective_error"]
    off = [r for r in cmp["collectives"] if r["ratio"] is None
           or abs(r["ratio"] - 1) > validation.TOLERANCE["collective"]]
    mem = [r for r in cmp["memory"] if r["ratio"] is None
           or abs(r["ratio"] - 1) > validation.TOLERANCE[r["what"]]]
    if bad:
        res.failure, res.detail = "numerics", "; ".join(bad) + (
            f" (worst: {res.numerics['where']})" if res.numerics.get("where") else "")
    elif off:
        res.failure = "census"
        res.detail = "; ".join(f"{r['kind']} {','.join(r['axes'])} {r['predicted']:,.0f} "
                               f"predicted, {r['compiled']:,.0f} compiled" for r in off[:3])
    elif mem:
        res.failure = "flops" if mem[0]["what"] == "flops" else "memory"
        res.detail = "; ".join(f"{r['what']} ratio {r['ratio']}" for r in mem)
    res.ok = not res.failure
    return res
