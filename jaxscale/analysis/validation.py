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

TOLERANCE = {"argument+output": 0.05, "temp": 0.15, "collective": 0.02, "flops": 0.05}


def scalar_bytes(spec) -> float:
    """The most bytes of the step's scalar partial sums (loss, token count, norms, flags: 16
    fp32; fp8's 18 amaxes per layer per micro-batch), in tuples (0 bytes in the census) or not:
    an all-reduce row of no more, or exceeding its formula by no more, matches."""
    from jaxscale.strategies.qat import N_SLOTS
    fp8 = N_SLOTS * spec.model.n_layers * max(1, spec.accumulate) if spec.qat == "fp8" else 0
    return 4.0 * (16 + fp8)


def comm_rows(pred, census: list[dict], backend: str = "cpu") -> list[dict]:
    """The collectives of `pred` against the census: `jaxscale.analysis.inspect.theory_vs_census`
    (the one comparison `inspect` prints too), with `predicted` / `compiled` bytes and their
    ratio."""
    from jaxscale.analysis.inspect import theory_vs_census
    scalars = scalar_bytes(pred.spec)

    def ratio(r):
        c, t = r["census_bytes"], r["theory_bytes"]
        if r["kind"] == "all-reduce" and (max(c, t) <= scalars or 0 <= c - t <= scalars):
            return 1.0                    # scalar partial sums, in tuples or alone
        if not r["census_bytes"]:
            return 1.0 if not r["theory_bytes"] else None
        return r["theory_bytes"] / r["census_bytes"]
    return [{"kind": r["kind"], "axes": r["axes"], "predicted": r["theory_bytes"],
             "compiled": r["census_bytes"], "ratio": ratio(r),
             "what": r["what"] or ("scalar partial sums only" if r["census_bytes"] <= scalars
                                   else ""),
             "note": r["note"]}
            for r in theory_vs_census(pred.collectives, census, backend)]


def compare(pred, report: dict, backend: str = "cpu") -> dict:
    """All rows for one config; `ok` says whether every row is inside `TOLERANCE`."""
    mem, xla = report["memory"], pred.memory.xla
    ao_c, ao_p = mem["argument"] + mem["output"], xla["argument"] + xla["output"]
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
    `--set`-style overrides: what the tests and the validation compile. Its optimizer takes a
    real AdamW update from the first step (no warm-up from learning rate 0; the decay is 1000
    steps long), so a step that claims to train moves the weights."""
    from jaxscale import meshes, models
    from jaxscale.config import Config, DataConfig, OptimConfig, TrainConfig, apply_overrides
    model = dataclasses.replace(models.get("tiny"), n_layers=2, **model_kw)
    cfg = Config(name="test", model=model, mesh=meshes.get("cpu8"),
                 data=DataConfig(seq_len=32, batch_size=8, max_bytes=400_000),
                 optim=OptimConfig(lr=1e-3, warmup_steps=0, decay_steps=1000),
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
    **{f"{name} diloco H2{tail}": (*PLANS[name], "plan.local_sgd=diloco", "plan.local_steps=2",
                                   *extra)
       for name, tail, extra in [("dp8", "", ()), ("dp8", " bf16", ("plan.precision=bf16",)),
                                 ("dp2xfsdp2xtp2", "", ()),
                                 ("dp8", " F2", ("plan.outer_fragments=2",)),
                                 ("dp8", " delayed", ("plan.outer_delay=1",))]},
}


# ----------------------------------------------------------------------------- published runs
@dataclasses.dataclass(frozen=True)
class Published:
    """A published training run, as its source states it, and the plan that describes it.

    `sets` is the plan in short: the hardware first, then mesh degrees (`tp=8`, `dp=64/64`: the
    degree, and after the slash its part across nodes), `seq=` and `batch=` (global, sequences),
    `attention=`, and any `plan.*` key. `tokens` is the published throughput in tokens/s per GPU,
    derived from `stated` (a TFLOP/s figure through the source's own FLOP count); both MFUs of
    the comparison are counted one way, `ModelConfig.flops_per_token` over the dense 16-bit peak.
    A row the planner misses by more than 15% says why in `outside`."""
    name: str
    source: str
    model: str
    sets: str
    layout: str
    stated: str
    tokens: float
    outside: str = ""
    note: str = ""


def megatron_tokens(tflops: float, model: str, seq: int, recompute: bool = True) -> float:
    """Tokens/s per GPU from a Megatron-LM figure: FLOPs per token 96 l h^2 (1 + s / 6h + V / 16lh)
    with full recompute (Narayanan et al. eq. 3), 72 l h^2 (1 + s / 6h + V / 12lh) without
    (Korthikanti et al.'s model FLOPs)."""
    from jaxscale import models
    m = models.get(model)
    L, h, V = m.n_layers, m.dim, m.vocab_size
    per_token = (96 * L * h * h * (1 + seq / (6 * h) + V / (16 * L * h)) if recompute else
                 72 * L * h * h * (1 + seq / (6 * h) + V / (12 * L * h)))
    return tflops * 1e12 / per_token


def _model_tokens(tflops: float, model: str, seq: int) -> float:
    from jaxscale import models
    return tflops * 1e12 / models.get(model).flops_per_token(seq)


_NARAYANAN = "Narayanan et al., SC'21 (arXiv 2104.04473), Table 1"
_KORTHIKANTI = ("Korthikanti et al., MLSys'23 (arXiv 2205.05198), abstract; the layout of "
                "Narayanan et al.'s 530B run (their Table 2)")
_TITAN_A100 = "torchtitan docs/performance.md (2024 revision: Llama 3 on 64 A100 80GB)"
_TITAN_H100 = "torchtitan docs/performance.md (2024-12, arXiv 2410.06511), Grand Teton H100"
_LLAMA3 = "Llama 3 (arXiv 2407.21783), Table 4"
_POWER = ("torchtitan's H100s ran at 500 W with HBM2e (2.4 TB/s), their peak 'between SXM and "
          "NVL' by torchtitan's note; its own figures put them at ~0.6 of the SXM H100 the "
          "planner's h100 is (Llama 3 8B with FSDP, eager: 5,762 tokens/s per GPU there against "
          "2,973 on A100, 1.9x for 3.2x in dense peak); at 0.6 of the rate the row is within 15%")
_GPT_NOTE = "micro-batch 1 (not stated); interleaved, 2 virtual stages (v not stated)"
PUBLISHED = (
    Published("Megatron-LM GPT 1.7B", _NARAYANAN, "gpt-1.7b",
              "a100 dp=32/4 seq=2048 batch=512 precision=fp16 remat=full accumulate=16 "
              "attention=xla", "DP32, 16 micro-batches, full recompute, fp16",
              "137 TFLOP/s per GPU (44% of peak, recompute counted)",
              megatron_tokens(137, "gpt-1.7b", 2048), note="micro-batch 1 (not stated)"),
    Published("Megatron-LM GPT 18.4B", _NARAYANAN, "gpt-18.4b",
              "a100 tp=8 dp=32/32 seq=2048 batch=1024 precision=fp16 remat=full accumulate=32 "
              "attention=xla", "TP8 x DP32, full recompute, fp16",
              "135 TFLOP/s per GPU (43%)", megatron_tokens(135, "gpt-18.4b", 2048),
              note="micro-batch 1 (not stated)"),
    Published("Megatron-LM GPT 145.6B", _NARAYANAN, "gpt-145.6b",
              "a100 tp=8 pp=8/8 dp=24/24 seq=2048 batch=2304 precision=fp16 remat=full "
              "accumulate=96 schedule=interleaved virtual_stages=2 attention=xla",
              "TP8 x PP8 x DP24, full recompute, fp16", "148 TFLOP/s per GPU (47%)",
              megatron_tokens(148, "gpt-145.6b", 2048), note=_GPT_NOTE),
    Published("Megatron-LM GPT 1T", _NARAYANAN, "gpt-1t",
              "a100 tp=8 pp=64/64 dp=6/6 seq=2048 batch=3072 precision=fp16 remat=full "
              "accumulate=512 schedule=interleaved virtual_stages=2 attention=xla",
              "TP8 x PP64 x DP6, full recompute, fp16", "163 TFLOP/s per GPU (52%)",
              megatron_tokens(163, "gpt-1t", 2048), note=_GPT_NOTE),
    Published("Megatron-LM 530B, SP + selective recompute", _KORTHIKANTI, "gpt-530b",
              "a100 tp=8 pp=35/35 dp=8/8 seq=2048 batch=2240 precision=bf16 accumulate=280 "
              "schedule=interleaved virtual_stages=3 sequence_parallel=true attention=xla "
              "remat=" + ",".join(f"{t}:{'remat' if t == 'attn_out' else 'save'}" for t in (
                  "attn_norm", "q_proj", "k_proj", "v_proj", "attn_out", "o_proj", "mlp_norm",
                  "mlp_gate", "mlp_up", "mlp_hidden", "mlp_down")),
              "TP8 x PP35 x DP8, Megatron SP, attention core recomputed, micro-batch 1",
              "54.2% MFU", megatron_tokens(0.542 * 312, "gpt-530b", 2048, recompute=False),
              note="3 virtual stages (the 3 layers of a stage, one each; v not stated)"),
    Published("Megatron-LM 530B, full recompute", _KORTHIKANTI, "gpt-530b",
              "a100 tp=8 pp=35/35 dp=8/8 seq=2048 batch=2240 precision=bf16 accumulate=280 "
              "schedule=interleaved virtual_stages=3 remat=full attention=xla",
              "TP8 x PP35 x DP8, full recompute, micro-batch 1", "42.1% MFU",
              megatron_tokens(0.421 * 312, "gpt-530b", 2048, recompute=False),
              note="3 virtual stages (v not stated)"),
    Published("BLOOM 176B", "BigScience tr11-176B-ml README (arXiv 2211.05100)", "bloom-176b",
              "a100-opa tp=4 dp=8/4 pp=12/12 seq=2048 batch=2048 precision=bf16 zero=1 "
              "remat=full accumulate=128 attention=xla",
              "TP4 x PP12 x DP8, ZeRO-1, micro-batch 2, full recompute, bf16, Omni-Path",
              "149.8 TFLOP/s (recompute counted): 19.56 samples/s, 104.7 s per step",
              19.561 * 2048 / 384),
    Published("torchtitan Llama 3 8B, FSDP", _TITAN_A100, "llama3-8b",
              "a100 fsdp=64/8 seq=8192 batch=64 precision=bf16 remat=save_dots "
              "attention=cudnn", "FSDP64, local batch 1, selective (op) AC, bf16",
              "2,973 tokens/s per GPU (58.2% MFU as torchtitan counts)", 2973),
    Published("torchtitan Llama 3 70B, FSDP", _TITAN_A100, "llama3-70b",
              "a100 fsdp=64/8 seq=8192 batch=64 precision=bf16 remat=full attention=cudnn",
              "FSDP64, local batch 1, full AC, bf16", "331 tokens/s per GPU (51.7%)", 331),
    Published("torchtitan Llama 3.1 8B, FSDP, compiled", _TITAN_H100, "llama3.1-8b",
              "h100 fsdp=8 seq=8192 batch=16 precision=bf16 remat=save_dots attention=cudnn",
              "FSDP8, local batch 2, selective AC, torch.compile, bf16",
              "6,667 tokens/s per GPU (38-39% MFU of the SXM peak)", 6667,
              outside=_POWER),
    Published("torchtitan Llama 3.1 405B, 3D, fp8", _TITAN_H100, "llama3.1-405b",
              "h100 tp=8 fsdp=8/8 pp=8/8 seq=8192 batch=256 precision=bf16 qat=fp8 remat=full "
              "accumulate=32 grad_sync=step schedule=interleaved virtual_stages=2 "
              "attention=cudnn", "FSDP8 x TP8 x PP8, interleaved 1F1B, Float8, full AC",
              "128 tokens/s per GPU", 128, outside=_POWER,
              note="2 virtual stages (v not stated); FSDP reduces once per step under PP"),
    Published("Llama 3 405B, 8,192 GPUs", _LLAMA3, "llama3-405b",
              "h100 tp=8 pp=16/16 dp=64/64 seq=8192 batch=2048 precision=bf16 zero=1 "
              "accumulate=32 schedule=interleaved virtual_stages=4 attention=cudnn",
              "TP8 x PP16 x DP64 (FSDP, ZeRO-2-like), interleaved, bf16",
              "430 TFLOP/s per GPU (43% BF16 MFU)", _model_tokens(430, "llama3-405b", 8192),
              note="4 virtual stages (v not stated), 126 layers over 64 chunks"),
    Published("Llama 3 405B, 16,384 GPUs", _LLAMA3, "llama3-405b",
              "h100 tp=8 pp=16/16 dp=128/128 seq=8192 batch=2048 precision=bf16 zero=1 "
              "accumulate=16 schedule=interleaved virtual_stages=4 attention=cudnn",
              "TP8 x PP16 x DP128, interleaved, bf16", "400 TFLOP/s per GPU (41%)",
              _model_tokens(400, "llama3-405b", 8192), note="4 virtual stages (v not stated)"),
    Published("Llama 3 405B, 131k context", _LLAMA3, "llama3.1-405b",
              "h100 tp=8 sp=16/16 pp=16/16 dp=8/8 seq=131072 batch=128 precision=bf16 zero=1 "
              "accumulate=16 context=allgather schedule=interleaved virtual_stages=4 "
              "attention=cudnn", "TP8 x CP16 (all-gather) x PP16 x DP8, bf16",
              "380 TFLOP/s per GPU (38%)", _model_tokens(380, "llama3.1-405b", 131072),
              note="4 virtual stages (v not stated)"),
    Published("Megatron-Core Mixtral 8x7B", "Megatron-LM megatron/core/transformer/moe/"
              "README.md (MCore v0.9; mapping of v0.8)", "mixtral-8x7b",
              "h100 ep=8 pp=4/4 dp=2/2 seq=4096 batch=256 precision=bf16 zero=1 accumulate=16 "
              "schedule=interleaved virtual_stages=8 moe_dispatch=ragged moe_buffer=1.0 "
              "moe_dropless=true attention=cudnn",
              "EP8 x PP4 (VP8) x DP2, dropless all-to-all, micro-batch 1",
              "468 TFLOP/s per GPU", _model_tokens(468, "mixtral-8x7b", 4096),
              note="dropless routing taken as balanced (1.0 x the even share per peer)"),
    Published("jaxscale 0.57B on one H200", "../shared/gpu/README.md (2026-11-30)", "tiny",
              "h200 seq=2048 batch=8 precision=bf16 attention=cudnn dim=2048 n_layers=12 "
              "n_heads=16 n_kv_heads=8 ffn_dim=5632", "one GPU, batch 8, bf16",
              "110,300 tokens/s (41% MFU)", 110_300,
              outside="measured at commit 70d3157: the step then also ran an 11.6 ms embedding "
              "scatter-add and ~19 ms of the scan's stacked copies and zero-fills, which "
              "f8b9de5 removed (a one-hot matmul, no fp32 residual stack); without them the "
              "measured step would be ~118 ms against 114 ms predicted (whose GEMM rate is this "
              "profile's: `hardware.py`)"),
)
_MODEL_KEYS = ("attention", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim",
               "moe_dropless")


def published_config(run: Published):
    """The `Config` of a published run (`Published.sets` unfolded into `--set` overrides)."""
    from jaxscale import models
    from jaxscale.axes import MESH_AXES
    from jaxscale.config import Config, DataConfig, apply_overrides
    from jaxscale.mesh import MeshConfig
    kind, *items = run.sets.split()
    sets = [f"mesh.device_kind={kind}"]
    for item in items:
        key, value = item.split("=", 1)
        if key in MESH_AXES:
            degree, _, nodes = value.partition("/")
            sets += [f"mesh.{key}={degree}"] + ([f"mesh.dcn_{key}={nodes}"] if nodes else [])
        elif key in ("seq", "batch"):
            sets.append(f"data.{'seq_len' if key == 'seq' else 'batch_size'}={value}")
        else:
            sets.append(f"{'model' if key in _MODEL_KEYS else 'plan'}.{key}={value}")
    cfg = apply_overrides(Config(model=models.get(run.model), mesh=MeshConfig()), sets)
    seq = cfg.data.seq_len
    return dataclasses.replace(cfg, model=dataclasses.replace(
        cfg.model, max_seq_len=max(seq, cfg.model.max_seq_len)), data=DataConfig(
        seq_len=seq, batch_size=cfg.data.batch_size))


def published_rows(runs=PUBLISHED, tolerance: float = 0.15) -> list[dict]:
    """Each published run against the planner: both MFUs (model FLOPs, 16-bit dense peak), their
    ratio, and whether it is inside `tolerance`."""
    from jaxscale import hardware
    from jaxscale.planner import predict
    out = []
    for run in runs:
        cfg = published_config(run)
        pred = predict(cfg)
        n = pred.spec.n_devices
        per_token = cfg.model.flops_per_token(cfg.data.seq_len)
        peak = hardware.get(cfg.mesh.device_kind).peak_bf16
        published = run.tokens * per_token / peak
        predicted = pred.time.tokens_per_s / n * per_token / peak
        ratio = predicted / published
        out.append({"name": run.name, "source": run.source, "gpus": n,
                    "hardware": cfg.mesh.device_kind, "layout": run.layout,
                    "stated": run.stated, "tokens_per_gpu": run.tokens,
                    "published_mfu": published, "predicted_mfu": predicted, "ratio": ratio,
                    "inside": abs(ratio - 1) <= tolerance, "outside": run.outside,
                    "note": run.note, "plan": pred.spec.label()})
    return out
