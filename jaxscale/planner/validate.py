"""Predicted vs compiled: the planner against `jaxscale.compiled.report` of the same config.

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

import dataclasses
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


# ----------------------------------------------------------------------------- the validation set
def tiny_config(*overrides: str, **model_kw):
    """The tiny LLaMA (2 layers, seq 32, batch 8) on the 8 simulated CPU devices (`cpu8`), with
    `--set`-style overrides: what the tests and the validation compile."""
    from jaxscale import meshes, models
    from jaxscale.config import Config, DataConfig, OptimConfig, TrainConfig, apply_overrides
    model = dataclasses.replace(models.get("tiny"), n_layers=2, **model_kw)
    cfg = Config(name="test", model=model, mesh=meshes.get("cpu8"),
                 data=DataConfig(seq_len=32, batch_size=8, max_bytes=400_000),
                 optim=OptimConfig(lr=1e-3, warmup_steps=2),
                 train=TrainConfig(steps=3, eval_every=0))
    return apply_overrides(cfg, list(overrides))


#: the single-strategy plans and the 2x2x2 mix on 8 devices
PLANS = {
    "dp8": ("mesh.dp=8", "mesh.fsdp=1", "mesh.tp=1"),
    "fsdp8": ("mesh.dp=1", "mesh.fsdp=8", "mesh.tp=1"),
    "tp8": ("mesh.dp=1", "mesh.fsdp=1", "mesh.tp=8", "model.n_kv_heads=8"),
    "dp2xfsdp2xtp2": ("mesh.dp=2", "mesh.fsdp=2", "mesh.tp=2"),
}
SMALL = ("model.dim=256", "model.ffn_dim=768", "model.n_layers=4", "data.seq_len=64",
         "data.batch_size=16")
#: name -> overrides on top of `tiny_config()`: every plan the planner is checked against the
#: compiler on (`experiments/planner_validation.py`); extend as strategies land.
CASES: dict[str, tuple[str, ...]] = {
    **PLANS,
    **{f"{name}/small": (*ov, *SMALL) for name, ov in PLANS.items()},
    "dp8 zero1": (*PLANS["dp8"], "plan.zero=1"),
    "dp8 zero2": (*PLANS["dp8"], "plan.zero=2"),
    "dp8 zero3": (*PLANS["dp8"], "plan.zero=3"),
    "dp2xfsdp2xtp2 zero1": (*PLANS["dp2xfsdp2xtp2"], "plan.zero=1"),
    "dp2xfsdp2xtp2 zero2": (*PLANS["dp2xfsdp2xtp2"], "plan.zero=2"),
    "dp2xfsdp2xtp2 zero3": (*PLANS["dp2xfsdp2xtp2"], "plan.zero=3"),
    "dp8 bf16": (*PLANS["dp8"], "plan.precision=bf16"),
    "fsdp8 bf16": (*PLANS["fsdp8"], "plan.precision=bf16"),
    "tp8 bf16": (*PLANS["tp8"], "plan.precision=bf16"),
    "dp8 remat=full": (*PLANS["dp8"], "plan.remat=full"),
    "dp8 remat=save_dots": (*PLANS["dp8"], "plan.remat=save_dots"),
    "dp8 remat=save_attention_out": (*PLANS["dp8"], "plan.remat=save_attention_out"),
    "dp8 remat=offload": (*PLANS["dp8"], "plan.remat=offload"),
    "tp8 remat=full": (*PLANS["tp8"], "plan.remat=full"),
    "dp8 acc2": (*PLANS["dp8"], "plan.accumulate=2", "data.batch_size=16"),
    "fsdp8 acc2": (*PLANS["fsdp8"], "plan.accumulate=2", "data.batch_size=16"),
    "dp8 offload=optimizer": (*PLANS["dp8"], "plan.offload=optimizer"),
    "fsdp8 bf16 remat=full acc2": (*PLANS["fsdp8"], "plan.precision=bf16", "plan.remat=full",
                                   "plan.accumulate=2", "data.batch_size=16"),
    "dp2xfsdp2xtp2 bf16 remat=save_dots": (*PLANS["dp2xfsdp2xtp2"], "plan.precision=bf16",
                                           "plan.remat=save_dots"),
}
