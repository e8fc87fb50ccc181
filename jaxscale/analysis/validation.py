"""Predicted vs compiled: the planner against `jaxscale.analysis.inspect.report` of the same config.

Rows compared (ratios are predicted / compiled):
- memory: argument + output bytes (`memory_analysis`), and temp;
- communication per (kind, mesh axes) of the census, in bytes, through the same comparison as
  `jaxscale inspect`'s theory (`jaxscale.analysis.inspect.theory_vs_census`): on XLA:CPU a
  reduce-scatter joins the all-reduce row of its axes (it is emitted as all-reduce + slice), and
  an `optional` collective is counted when that brings the row closer to the census;
- FLOPs: matmul FLOPs per device against the HLO's dot FLOPs (loop trip counts included).
On XLA:CPU `memory_analysis` counts host-offloaded (`pinned_host`) state as arguments, so the
comparison adds the planner's host-resident state to its argument + output bytes.
"""
from __future__ import annotations

import dataclasses

TOLERANCE = {"argument+output": 0.05, "temp": 0.20, "collective": 0.02, "flops": 0.05}


def comm_rows(pred, census: list[dict], backend: str = "cpu") -> list[dict]:
    """The collectives of `pred` against the census: `jaxscale.analysis.inspect.theory_vs_census`
    (the one comparison `inspect` prints too), with `predicted` / `compiled` bytes and their
    ratio."""
    from jaxscale.analysis.inspect import theory_vs_census
    def ratio(r):
        if not r["census_bytes"]:        # scalar partial sums in tuples count 0 bytes on both
            return 1.0 if not r["theory_bytes"] else None     # sides (e.g. the gradient norm
        return r["theory_bytes"] / r["census_bytes"]          # over ep): nothing to compare
    return [{"kind": r["kind"], "axes": r["axes"], "predicted": r["theory_bytes"],
             "compiled": r["census_bytes"], "ratio": ratio(r),
             "what": r["what"] or ("scalar partial sums only" if not r["census_bytes"] else ""),
             "note": r["note"]}
            for r in theory_vs_census(pred.collectives, census, backend)]


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
#: mixture-of-experts plans (8 experts, top-2, capacity factor 1.25 unless dropless): expert
#: parallelism with the data axes, tp, remat, bf16, accumulation and ZeRO-1; the grouped experts
#: (dropless under ep: the bounded exchange; without ep over dp and fsdp x tp; a sequence split
#: by Megatron SP or context parallelism); `moe` is added to each name
MOE = {
    "dp2xep4": ("mesh.dp=2", "mesh.fsdp=1", "mesh.tp=1", "mesh.ep=4"),
    "fsdp2xep2xtp2": ("mesh.dp=1", "mesh.fsdp=2", "mesh.tp=2", "mesh.ep=2"),
    "ep8 dropless": ("mesh.dp=1", "mesh.fsdp=1", "mesh.tp=1", "mesh.ep=8",
                     "model.moe_dropless=true"),
    "dp8 dropless": (*PLANS["dp8"], "model.moe_dropless=true"),
    "dp2xep4 dropless": ("mesh.dp=2", "mesh.fsdp=1", "mesh.tp=1", "mesh.ep=4",
                         "model.moe_dropless=true"),
    "dp2xfsdp2xtp2 dropless": (*PLANS["dp2xfsdp2xtp2"], "model.moe_dropless=true"),
    "ep4xtp2 megatron-sp dropless": ("mesh.dp=1", "mesh.fsdp=1", "mesh.tp=2", "mesh.ep=4",
                                     "plan.sequence_parallel=true", "model.moe_dropless=true"),
    "ep2xsp2xtp2 ring": ("mesh.dp=1", "mesh.fsdp=1", "mesh.tp=2", "mesh.ep=2", "mesh.sp=2"),
    "dp2xep4 remat=full": ("mesh.dp=2", "mesh.fsdp=1", "mesh.tp=1", "mesh.ep=4",
                           "plan.remat=full"),
    "ep4xtp2 remat=full": ("mesh.dp=1", "mesh.fsdp=1", "mesh.tp=2", "mesh.ep=4",
                           "plan.remat=full"),
    "dp2xep4 bf16": ("mesh.dp=2", "mesh.fsdp=1", "mesh.tp=1", "mesh.ep=4",
                     "plan.precision=bf16"),
    "fsdp2xep4 acc2": ("mesh.dp=1", "mesh.fsdp=2", "mesh.tp=1", "mesh.ep=4",
                       "plan.accumulate=2", "data.batch_size=16"),
    "dp2xep4 zero1": ("mesh.dp=2", "mesh.fsdp=1", "mesh.tp=1", "mesh.ep=4", "plan.zero=1"),
    "dp2xep4 zero3 dropless": ("mesh.dp=2", "mesh.fsdp=1", "mesh.tp=1", "mesh.ep=4",
                               "plan.zero=3", "model.moe_dropless=true"),
    "fsdp2xep2xtp2 deepseek": ("mesh.dp=1", "mesh.fsdp=2", "mesh.tp=2", "mesh.ep=2",
                               "model.moe_ffn_dim=64", "model.moe_shared_experts=1",
                               "model.moe_bias_rate=0.001", "model.moe_dropless=true"),
}
#: pipeline plans (4 layers): every schedule, composed with fsdp, tp, dp + ZeRO, bf16 and remat
PIPELINE = {
    "pp2xfsdp4 gpipe m4": ("mesh.dp=1", "mesh.pp=2", "mesh.fsdp=4", "mesh.tp=1",
                           "plan.schedule=gpipe", "plan.accumulate=4", "data.batch_size=16"),
    "pp2xfsdp4 1f1b m4": ("mesh.dp=1", "mesh.pp=2", "mesh.fsdp=4", "mesh.tp=1",
                          "plan.schedule=1f1b", "plan.accumulate=4", "data.batch_size=16"),
    "pp2xfsdp2xtp2 interleaved v2 m4": ("mesh.dp=1", "mesh.pp=2", "mesh.fsdp=2", "mesh.tp=2",
                                        "plan.schedule=interleaved", "plan.virtual_stages=2",
                                        "plan.accumulate=4", "data.batch_size=16"),
    "pp4xfsdp2 zb-h1 m4": ("mesh.dp=1", "mesh.pp=4", "mesh.fsdp=2", "mesh.tp=1",
                           "plan.schedule=zb-h1", "plan.accumulate=4", "data.batch_size=16"),
    "dp2xpp2xtp2 naive zero1 bf16": ("mesh.dp=2", "mesh.pp=2", "mesh.fsdp=1", "mesh.tp=2",
                                     "plan.schedule=naive", "plan.zero=1",
                                     "plan.precision=bf16"),
    "dp2xpp2xtp2 gpipe m2 zero1 bf16 remat=full": (
        "mesh.dp=2", "mesh.pp=2", "mesh.fsdp=1", "mesh.tp=2", "plan.schedule=gpipe",
        "plan.accumulate=2", "plan.zero=1", "plan.precision=bf16", "plan.remat=full"),
}
#: name -> overrides on top of `tiny_config()`: every plan the planner is checked against the
#: compiler on (`experiments/planner_validation.py`); extend as strategies land.
CASES: dict[str, tuple[str, ...]] = {
    **PLANS,
    **{f"{name}/small": (*ov, *SMALL) for name, ov in PLANS.items()},
    "fsdp2xtp4 megatron-sp": ("mesh.dp=1", "mesh.fsdp=2", "mesh.tp=4", "model.n_kv_heads=8",
                              "plan.sequence_parallel=true"),
    "dp2xtp4 megatron-sp": ("mesh.dp=2", "mesh.fsdp=1", "mesh.tp=4", "model.n_kv_heads=8",
                            "plan.sequence_parallel=true"),
    "fsdp2xsp2xtp2 ring": ("mesh.dp=1", "mesh.fsdp=2", "mesh.sp=2", "mesh.tp=2",
                           "plan.context=ring"),
    "fsdp4xsp2 ulysses": ("mesh.dp=1", "mesh.fsdp=4", "mesh.sp=2", "mesh.tp=1",
                          "plan.context=ulysses"),
    "dp2xsp4 allgather": ("mesh.dp=2", "mesh.fsdp=1", "mesh.sp=4", "mesh.tp=1",
                          "plan.context=allgather"),
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
    **{f"{name} moe": (*ov, "model.moe_experts=8") for name, ov in MOE.items()},
    **{f"{name}": (*ov, "model.n_layers=4") for name, ov in PIPELINE.items()},
}
