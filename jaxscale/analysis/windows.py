"""What compute the scheduled program can run under each collective (`compiled.as_text()`).

A compiled module is printed `is_scheduled=true`: each computation lists its instructions in the
order they run. For every collective this module finds its window in that order:
- an asynchronous pair (`all-gather-start` ... `all-gather-done`, `collective-permute-start`
  ... `-done`, as XLA:GPU emits them): from the start to the done. Compute scheduled between
  them runs while the transfer is in flight;
- a synchronous collective (XLA:CPU runs them in line): from its last producer (the latest
  operand definition) to its first consumer. Compute scheduled there depends on neither side
  of it: an asynchronous collective could be in flight under it.

Compute is matmul work: a `dot`, or a fusion or custom call whose computation holds dots, with
its FLOPs (`hlo` reads them). Beside the window, `independent_flops` counts the matmul FLOPs of
the whole computation that are neither ancestors nor descendants of the collective in the data
flow: what a scheduler could put under it at best. `summary` gives the fraction of collective
bytes (per device, loop trip counts included) with matmul work in their window.
"""
from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass

from jaxscale.analysis import hlo, hlo_flops

_NAME = re.compile(r"%([\w.\-]+)")


@dataclass
class Window:
    name: str
    kind: str                 # all-gather | ... | collective-permute
    axes: tuple               # the mesh axes it runs over (with `mesh`), else ()
    asynchronous: bool
    computation: str
    runs: float               # executions per step
    bytes: float              # per-device result bytes of one execution
    window_ops: int           # matmul instructions scheduled inside the window
    window_flops: float       # their FLOPs (one execution)
    independent_flops: float  # matmul FLOPs of the computation independent of the collective


def _matmul_flops(mod: hlo.Module) -> dict[tuple[str, str], float]:
    """(computation, instruction) -> matmul FLOPs of one execution, where a fusion or call
    counts the dots of the computations it calls (`calls=`)."""
    per_comp: dict[str, float] = defaultdict(float)
    for _src, ins, f in hlo_flops.matmuls(mod):
        per_comp[ins.computation] += f
    out = {}
    for ins in mod.instrs:
        f = 0.0
        if ins.opcode == "dot":
            f = hlo_flops._dot(mod, ins)
        elif ins.opcode in ("fusion", "custom-call", "call"):
            m = re.search(r"\b(?:calls|to_apply)=%?([\w.\-]+)", ins.rest)
            f = per_comp.get(m.group(1), 0.0) if m else 0.0
        if f:
            out[(ins.computation, ins.name)] = f
    return out


def _closure(start: str, edges: dict[str, list[str]]) -> set[str]:
    seen, stack = set(), [start]
    while stack:
        for n in edges.get(stack.pop(), ()):
            if n not in seen:
                seen.add(n)
                stack.append(n)
    return seen


def _axes(ins: hlo.Instr, kind: str, mesh) -> tuple:
    from jaxscale.analysis.inspect import axes_of_group
    if kind == "collective-permute":
        pairs = [p for p in hlo.source_target_pairs(ins.rest) if p[0] != p[1]]
        axes = {a for p in pairs for a in axes_of_group(p, mesh)}
        return tuple(a for a in mesh.axis_names if a in axes)
    groups = hlo.replica_groups(ins.rest) or [list(range(mesh.devices.size))]
    return axes_of_group(groups[0], mesh)


def windows(text: str, mesh=None) -> list[Window]:
    """One `Window` per collective instruction (an async pair once, at its start); with the
    `mesh`, each names the mesh axes it runs over."""
    mod = hlo.Module(text)
    flops = _matmul_flops(mod)
    by_comp: dict[str, list[hlo.Instr]] = defaultdict(list)
    for ins in mod.instrs:
        by_comp[ins.computation].append(ins)
    out = []
    for comp, instrs in by_comp.items():
        if not any(hlo.collective_kind(i.opcode) for i in instrs) or not mod.runs.get(comp):
            continue
        pos = {i.name: k for k, i in enumerate(instrs)}
        preds = {i.name: [n for n in _NAME.findall(hlo._operand_text(i.rest)) if n in pos]
                 for i in instrs}
        succs: dict[str, list[str]] = defaultdict(list)
        for n, ps in preds.items():
            for p in ps:
                succs[p].append(n)
        mm = [(i.name, flops[(comp, i.name)]) for i in instrs if (comp, i.name) in flops]
        for ins in instrs:
            kind = hlo.collective_kind(ins.opcode)
            if kind is None:
                continue
            asynchronous = ins.opcode.endswith("-start")
            if asynchronous:
                done = [s for s in succs[ins.name] if instrs[pos[s]].opcode.endswith("-done")]
                lo, hi = pos[ins.name], min((pos[d] for d in done), default=len(instrs))
                users = set(done)
            else:
                lo = max((pos[p] for p in preds[ins.name]), default=-1)
                hi = min((pos[s] for s in succs[ins.name]), default=len(instrs))
                users = {ins.name}
            ancestors = _closure(ins.name, preds)
            descendants = set().union(*(_closure(u, succs) | {u} for u in users))
            inside = [(n, f) for n, f in mm if lo < pos[n] < hi and n != ins.name]
            free = sum(f for n, f in mm if n not in ancestors and n not in descendants
                       and n != ins.name)
            axes = _axes(ins, kind, mesh) if mesh is not None else ()
            out.append(Window(ins.name, kind, axes, asynchronous, comp, mod.runs[comp],
                              hlo.result_bytes(ins, kind), len(inside),
                              sum(f for _, f in inside), free))
    return out


def summary(ws: list[Window], axes: tuple | None = None) -> dict:
    """Per kind and in total ("all"): collectives per step, their bytes, and the fraction of
    those bytes with matmul work scheduled in their window (`covered`) / available
    independently (`coverable`); `axes`: only the collectives over exactly these mesh axes."""
    rows: dict[str, dict] = {}
    for w in ws:
        if axes is not None and tuple(w.axes) != tuple(axes):
            continue
        for key in (w.kind, "all"):
            r = rows.setdefault(key, {"count": 0.0, "bytes": 0.0, "covered_bytes": 0.0,
                                      "coverable_bytes": 0.0, "async": 0.0, "window_ops": 0.0})
            r["count"] += w.runs
            r["bytes"] += w.bytes * w.runs
            r["covered_bytes"] += w.bytes * w.runs * (w.window_flops > 0)
            r["coverable_bytes"] += w.bytes * w.runs * (w.independent_flops > 0)
            r["async"] += w.runs * w.asynchronous
            r["window_ops"] += w.window_ops * w.runs
    for r in rows.values():
        r["covered"] = r["covered_bytes"] / r["bytes"] if r["bytes"] else 0.0
        r["coverable"] = r["coverable_bytes"] / r["bytes"] if r["bytes"] else 0.0
    return rows
