"""Predicted vs compiled: the planner against `jaxscale.inspect.report` of the same config.

Rows compared (ratios are predicted / compiled):
- memory: argument + output bytes (`memory_analysis`), and temp;
- communication per (kind, mesh axes) of the census, in bytes. The prediction is first put in
  the kinds the backend emits: on XLA:CPU a reduce-scatter is an all-reduce + slice (each
  predicted collective carries its `cpu_kind`), so it joins the all-reduce row of its axes. A
  collective marked `optional` (XLA may merge it with an identical earlier one) is counted when
  that brings the row closer to the census, and the row says so;
- FLOPs: matmul FLOPs per device against the HLO's dot FLOPs (loop trip counts included).
On XLA:CPU `memory_analysis` counts host-offloaded (`pinned_host`) state as arguments, so the
comparison adds the planner's host-resident state to its argument + output bytes.
"""
from __future__ import annotations

from collections import defaultdict

TOLERANCE = {"argument+output": 0.05, "temp": 0.15, "collective": 0.02, "flops": 0.05}


def comm_rows(pred, census: list[dict], backend: str = "cpu") -> list[dict]:
    want: dict[tuple, list] = defaultdict(lambda: [0.0, 0.0, []])   # required, optional, what
    for c in pred.collectives:
        kind = (c.cpu_kind or c.kind) if backend == "cpu" else c.kind
        row = want[(kind, tuple(c.axes))]
        row[1 if c.optional else 0] += c.bytes
        row[2].append(c.what + (" [optional]" if c.optional else ""))
    got = defaultdict(float)
    for c in census:
        got[(c["kind"], tuple(c["axes"]))] += c["bytes"]
    rows = []
    for key in sorted(set(want) | set(got)):
        required, optional, what = want.get(key, (0.0, 0.0, []))
        measured = got.get(key, 0.0)
        predicted, note = required, ""
        if optional and abs(required + optional - measured) < abs(required - measured):
            predicted, note = required + optional, "optional collective emitted"
        elif optional:
            note = "optional collective merged by XLA"
        if backend == "cpu" and any(c.cpu_kind and (c.cpu_kind, tuple(c.axes)) == key
                                    for c in pred.collectives):
            note = "; ".join(n for n in (note, "includes reduce-scatters XLA:CPU emits as "
                                         "all-reduce + slice") if n)
        rows.append({"kind": key[0], "axes": list(key[1]), "predicted": predicted,
                     "compiled": measured, "ratio": predicted / measured if measured else None,
                     "what": "; ".join(what), "note": note})
    return rows


def compare(pred, report: dict, backend: str = "cpu") -> dict:
    """All rows for one config; `ok` says whether every row is inside `TOLERANCE`."""
    mem, xla = report["memory"], pred.memory.xla
    ao_c = mem["argument"] + mem["output"]
    ao_p = xla["argument"] + xla["output"]
    if backend == "cpu":    # XLA:CPU reports pinned_host buffers as arguments: all memory is host
        ao_p += xla.get("host_argument", 0.0) + xla.get("host_output", 0.0)
    rows = [{"what": "argument+output", "predicted": ao_p, "compiled": ao_c, "ratio": ao_p / ao_c},
            {"what": "temp", "predicted": xla["temp"], "compiled": mem["temp"],
             "ratio": xla["temp"] / mem["temp"] if mem["temp"] else None},
            {"what": "flops", "predicted": pred.flops.per_device,
             "compiled": report["flops"]["dot_flops"],
             "ratio": pred.flops.per_device / report["flops"]["dot_flops"]}]
    comms = comm_rows(pred, report["collectives"], backend)
    ok = all(r["ratio"] is not None and abs(r["ratio"] - 1) <= TOLERANCE[r["what"]] for r in rows)
    ok = ok and all(r["ratio"] is not None and abs(r["ratio"] - 1) <= TOLERANCE["collective"]
                    for r in comms)
    worst_comm = max((abs(r["ratio"] - 1) for r in comms if r["ratio"]), default=0.0)
    return {"plan": pred.spec.label(), "memory": rows, "collectives": comms, "ok": ok,
            "worst_collective_error": worst_comm}


def format_comparison(cmp: dict) -> str:
    lines = [f"{cmp['plan']}: {'ok' if cmp['ok'] else 'OUTSIDE TOLERANCE'}"]
    for r in cmp["memory"]:
        lines.append(f"  {r['what']:<38}{r['predicted']:>16,.0f}{r['compiled']:>16,.0f}"
                     f"  {r['ratio']:.3f}")
    for r in cmp["collectives"]:
        ratio = f"{r['ratio']:.3f}" if r["ratio"] is not None else "  -  "
        name = f"{r['kind']} {','.join(r['axes'])}"
        lines.append(f"  {name:<38}{r['predicted']:>16,.0f}{r['compiled']:>16,.0f}  {ratio}"
                     + (f"  ({r['note']})" if r["note"] else ""))
    return "\n".join(lines)
