"""Compile -> per-device memory, the collective census, FLOPs, and the plan's theory beside them.

The census groups every collective of the compiled step by (kind, mesh axes): `count` is how many
times it runs per step (loop trip counts included), `bytes` the per-device message size summed
over those runs (nccl-tests' "size": the output of an all-gather, the input of a reduce-scatter),
and `wire_bytes` what a bandwidth-optimal ring puts on each device's link for it (x 2(n-1)/n for
all-reduce, x (n-1)/n for the others). The axes are read from the replica groups, not assumed.

The theory beside the census is the plan's own: `jaxscale.plan.collectives`, each strategy's
formula (the same the planner predicts with), with the theoretical minimum where XLA's program
moves more. XLA:CPU lowers a gradient reduction whose result is sliced as an all-reduce where
XLA:GPU emits a reduce-scatter; each predicted collective names the kind XLA:CPU emits
(`Comm.cpu_kind`), and `theory_vs_census` says where it used it instead of hiding it.
"""
from __future__ import annotations

import itertools
from collections import defaultdict

import numpy as np
from jax.sharding import Mesh

from jaxscale.analysis import hlo, hlo_flops
from jaxscale.cost import busbw_factor
from jaxscale.strategies.common import Comm
from jaxscale.strategies.precision import cpu_widened


def axes_of_group(group, mesh: Mesh) -> tuple[str, ...]:
    coords = np.array([np.unravel_index(d, mesh.devices.shape) for d in group])
    varying = [i for i in range(coords.shape[1]) if len(set(coords[:, i])) > 1]
    return tuple(mesh.axis_names[i] for i in varying)


def census(text: str, mesh: Mesh, branch_share: list[float] | None = None,
           widen: tuple[str, ...] = ()) -> list[dict]:
    """Collectives of a compiled HLO module, aggregated by (kind, axes) (`branch_share`: see
    `hlo.Module`; `widen`: dtypes counted at 4 bytes, `cpu_widened`)."""
    mod = hlo.Module(text, branch_share)
    agg: dict[tuple, dict] = defaultdict(lambda: {"count": 0.0, "bytes": 0.0, "wire_bytes": 0.0})
    n_dev = mesh.devices.size
    for ins in mod.instrs:
        kind = hlo.collective_kind(ins.opcode)
        if kind is None:
            continue
        runs = mod.runs.get(ins.computation, 0.0)
        if runs == 0:
            continue
        size = hlo.result_bytes(ins, kind, widen)
        if kind == "collective-permute":
            pairs = [p for p in hlo.source_target_pairs(ins.rest) if p[0] != p[1]]
            if not pairs:
                continue
            axes = tuple(sorted({a for p in pairs for a in axes_of_group(p, mesh)},
                                key=mesh.axis_names.index))
            n = 2
        else:
            groups = hlo.replica_groups(ins.rest) or [list(range(n_dev))]
            n = len(groups[0])
            if n == 1:
                continue
            axes = axes_of_group(groups[0], mesh)
            if kind == "reduce-scatter":
                size *= n
        row = agg[(kind, axes)]
        row["count"] += runs
        row["bytes"] += size * runs
        row["wire_bytes"] += size * runs * busbw_factor(kind, n)
    out = [{"kind": k, "axes": list(a), "count": int(round(v["count"])), "bytes": int(v["bytes"]),
            "wire_bytes": int(v["wire_bytes"])} for (k, a), v in agg.items()]
    order = {k: i for i, k in enumerate(hlo.COLLECTIVES)}
    return sorted(out, key=lambda r: (order[r["kind"]], r["axes"]))


def memory(compiled) -> dict:
    m = compiled.memory_analysis()
    d = {k: int(getattr(m, f"{k}_size_in_bytes", 0)) for k in
         ("argument", "output", "temp", "alias", "generated_code")}
    d.update({f"host_{k}": int(getattr(m, f"host_{k}_size_in_bytes", 0))
              for k in ("argument", "output", "temp", "alias")})
    d["total"] = d["argument"] + d["output"] + d["temp"] - d["alias"]
    return d


def flops(compiled, text: str | None = None, branch_share: list[float] | None = None) -> dict:
    """Matmul FLOPs per device per step from the HLO (loop-aware; dots, cuBLAS and cuDNN custom
    calls, Triton gemm fusions: `hlo_flops.matmul_flops`), and XLA's own estimate."""
    text = text or compiled.as_text()
    ca = compiled.cost_analysis()
    ca = ca[0] if isinstance(ca, (list, tuple)) else ca
    by_source = hlo_flops.matmul_flops(hlo.Module(text, branch_share))
    return {"dot_flops": sum(by_source.values()), "matmul_flops_by_source": by_source,
            "xla_cost_analysis_flops": float((ca or {}).get("flops", 0.0))}


def theory_vs_census(theory: list[Comm], observed: list[dict], backend: str = "cpu") -> list[dict]:
    """One row per (kind, mesh axes) in either list: theory bytes, census bytes, their ratio
    (census / theory) and the theoretical minimum.

    On XLA:CPU a predicted collective is put in the kind XLA:CPU emits (`Comm.cpu_kind`: a
    reduce-scatter becomes all-reduce + slice). A collective marked `optional` (XLA may merge it
    with an identical earlier one) is counted when that brings the row closer to the census, and
    the row says which it saw; of several in a row, the set that brings it closest."""
    want: dict[tuple, list] = defaultdict(lambda: [0.0, [], 0.0, [], False])
    for c in theory:
        kind = (c.cpu_kind or c.kind) if backend == "cpu" else c.kind
        row = want[(kind, tuple(c.axes))]
        if c.optional:
            row[1].append(c.bytes)
        else:
            row[0] += c.bytes
        row[2] += 0.0 if c.optional else (c.bytes if c.minimum is None else c.minimum)
        row[3].append(c.what + (" [optional]" if c.optional else ""))
        row[4] = row[4] or kind != c.kind
    got: dict[tuple, float] = defaultdict(float)
    for c in observed:
        got[(c["kind"], tuple(c["axes"]))] += c["bytes"]
    rows = []
    for key in sorted(set(want) | set(got), key=lambda k: (hlo.COLLECTIVES.index(k[0]), k[1])):
        required, optional, minimum, what, as_cpu = want.get(key, (0.0, [], 0.0, [], False))
        census_bytes = got.get(key, 0.0)
        emitted = min((sum(c) for k in range(len(optional) + 1)
                       for c in itertools.combinations(optional, k)),
                      key=lambda b: abs(required + b - census_bytes))
        theory_bytes, minimum, notes = required + emitted, minimum + emitted, []
        if emitted:
            notes.append("optional collective emitted")
        if emitted < sum(optional):
            notes.append("optional collective merged by XLA")
        if as_cpu:
            notes.append("includes reduce-scatters XLA:CPU emits as all-reduce + slice")
        rows.append({"kind": key[0], "axes": list(key[1]), "theory_bytes": int(theory_bytes),
                     "census_bytes": int(census_bytes), "minimum_bytes": int(minimum),
                     "ratio": census_bytes / theory_bytes if theory_bytes else None,
                     "what": "; ".join(what), "note": "; ".join(notes)})
    _merged_groups(rows)
    return rows


def _merged_groups(rows: list[dict]) -> None:
    """Note where XLA reduces over several mesh axes in one collective (one replica group over
    the merged axes) that the formulas count as separate rows over some of them: a census row
    the theory lacks, whose axes the theory's rows of its kind over fewer axes, each carrying
    more than the census there, cover together. The rows stay as they are (the census's grouping
    is XLA's, the formula's to match); the note names the rows to merge."""
    for row in rows:
        if row["theory_bytes"] or len(row["axes"]) < 2:
            continue
        parts = [r for r in rows if r is not row and r["kind"] == row["kind"] and r["axes"]
                 and set(r["axes"]) < set(row["axes"]) and r["theory_bytes"] > r["census_bytes"]]
        if set().union(*(set(r["axes"]) for r in parts)) != set(row["axes"]):
            continue
        group = "(" + ", ".join(row["axes"]) + ")"
        names = " and ".join("(" + ", ".join(r["axes"]) + ")" for r in parts)
        _note(row, f"XLA reduces over {group} at once, where the theory counts {names} apart")
        for r in parts:
            _note(r, f"part of it reduced by XLA over {group} at once")


def _note(row: dict, text: str) -> None:
    row["note"] = "; ".join(n for n in (row["note"], text) if n)


def format_report(rep: dict) -> str:
    """Human-readable tables for `jaxscale inspect`."""
    mib = lambda b: f"{b / 2**20:10.3f} MiB"
    lines = ["per-device memory (compiled):"]
    for k in ("argument", "output", "temp", "alias", "host_argument", "host_temp", "total"):
        lines.append(f"  {k:<14}{mib(rep['memory'][k])}")
    lines.append("collective census (per device, per step):")
    lines.append(f"  {'kind':<19}{'axes':<14}{'count':>7}{'bytes':>16}{'wire bytes':>16}")
    for c in rep["collectives"] or [{"kind": "(none)", "axes": [], "count": 0, "bytes": 0,
                                     "wire_bytes": 0}]:
        lines.append(f"  {c['kind']:<19}{','.join(c['axes']) or '-':<14}{c['count']:>7}"
                     f"{c['bytes']:>16,}{c['wire_bytes']:>16,}")
    f = rep["flops"]
    lines.append(f"flops per device per step: {f['dot_flops']:.4g} (matmul, from HLO), "
                 f"model formula {f['model_flops_per_device']:.4g}")
    lines.append("theory vs census (theory: the plan's formulas; minimum: the least any program "
                 "could move):")
    lines.append(f"  {'kind':<19}{'axes':<14}{'theory':>16}{'census':>16}{'ratio':>8}"
                 f"{'minimum':>16}  what")
    for t in rep["theory"]:
        ratio = f"{t['ratio']:.3f}" if t["ratio"] is not None else "-"
        lines.append(f"  {t['kind']:<19}{','.join(t['axes']):<14}{t['theory_bytes']:>16,}"
                     f"{t['census_bytes']:>16,}{ratio:>8}{t['minimum_bytes']:>16,}  {t['what']}"
                     + (f" ({t['note']})" if t["note"] else ""))
    return "\n".join(lines)



def report(cfg, devices=None) -> dict:
    """Compile the train step of `cfg` without running it; the `jaxscale inspect --json` object."""
    import jax

    from jaxscale import plan as plan_lib
    from jaxscale.train.setup import build

    setup = build(cfg, devices)
    compiled = setup.lower_train_step().compile()
    text = compiled.as_text()
    placement = setup.placement
    n_dev = placement.mesh.devices.size
    share = plan_lib.branch_share(placement.spec)
    fl = flops(compiled, text, share)
    tokens = cfg.data.batch_size * cfg.data.seq_len
    fl["model_flops_per_device"] = cfg.model.flops_per_token(cfg.data.seq_len) * tokens / n_dev
    backend = "cpu" if jax.default_backend() == "cpu" else "gpu"
    spec = placement.spec
    widen = cpu_widened(spec) if backend == "cpu" else ()
    observed = census(text, placement.mesh, share, widen)
    if backend == "cpu" or spec.device_kind == "cpu":     # the theory of the backend compiled for
        spec = spec.with_(device_kind="cpu" if backend == "cpu" else "h100")
    theory = theory_vs_census(plan_lib.collectives(spec), observed, backend)
    if backend == "cpu" and setup.policy.param_dtype != "float32":
        why = ("float16 collectives counted at 4 bytes, as XLA:CPU carries bf16 ones" if widen
               else "16-bit values carried in f32: XLA:CPU widens them after partitioning")
        for r in theory:
            r["note"] = "; ".join(n for n in (r["note"], why) if n)
    return {
        "mesh": {a: int(s)
                 for a, s in zip(placement.mesh.axis_names, placement.mesh.devices.shape)},
        "rules": placement.rules.as_dict(),
        "memory": memory(compiled),
        "collectives": observed,
        "flops": fl,
        "theory": theory,
    }


def offloaded_activation_bytes(fn, *args) -> float:
    """Bytes a program's remat policy sends to host memory per call (all devices together).

    Read from the jaxpr: each `device_put` into host memory space that the checkpoint policy
    inserted, times the trip count of the scans around it. (XLA:CPU keeps both memory kinds in the
    same RAM and drops the annotations when compiling; on GPU the compiled program's host buffers
    show the same bytes.)"""
    import jax

    def walk(jaxpr, times):
        total = 0.0
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "device_put":
                for dev, v in zip(eqn.params.get("devices", ()), eqn.outvars):
                    if "host" in str(dev).lower():
                        total += times * v.aval.size * v.aval.dtype.itemsize
            mult = eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1
            for p in eqn.params.values():
                for sub in (p if isinstance(p, (list, tuple)) else (p,)):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        total += walk(inner, times * mult)
        return total
    return walk(jax.make_jaxpr(fn)(*args).jaxpr, 1.0)


def donation_report(cfg, devices=None) -> dict:
    """Peak per-device memory of the train step with and without donating the train state."""
    from jaxscale.train.setup import build
    out = {}
    for donate in (True, False):
        mem = memory(build(cfg, devices, donate=donate).lower_train_step().compile())
        out["donated" if donate else "not_donated"] = mem
    out["saved_bytes"] = out["not_donated"]["total"] - out["donated"]["total"]
    return out
