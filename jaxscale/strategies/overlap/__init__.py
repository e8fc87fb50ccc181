"""Overlapping communication with computation: collective matmul for tensor parallelism
(`plan.tp_overlap`) and XLA scheduler presets (`plan.xla_preset`).

`plan.tp_overlap=collective_matmul` (or `collective_matmul_bidirectional`) runs the
tensor-parallel matmuls of a block as collective matmuls
(`jaxscale.strategies.overlap.collective_matmul`) inside `jax.shard_map` over the whole mesh: the
column-parallel q, k, v, gate and up projections as all-gather-matmuls of the sequence-parallel
residual stream, the row-parallel o and down projections as matmul-reduce-scatters back to it. It
needs Megatron sequence parallelism (`plan.sequence_parallel=true`): that is what makes the block's
collectives an all-gather before and a reduce-scatter after the matmuls, which the ring hops
replace. The LM head stays GSPMD's (a vocabulary-parallel matmul, not a sequence gather).

Collectives, per layer and micro-batch, with bsh the [micro-batch, sequence, dim] activation
and t = mesh.tp: every ring is t-1 `collective-permute`s of one bsh/t chunk (the bytes a ring
all-gather or reduce-scatter of bsh puts on each link), and the block runs 10 of them, one for
each all-gather or reduce-scatter of GSPMD's sequence parallelism with tp's column groups:
forward, one gathering ring per column group (q, k and v compute their three products from
each chunk as it passes, gate and up theirs) and the o and down scattering rings; backward,
the two gathering rings again for the weight gradients (nothing inside the collective matmul is
kept, as GSPMD re-gathers the norm outputs: the same activation memory), one reverse ring per
group for its input gradient (the group's three or two partial products summed per chunk
before it travels: the backward of a permute is the reverse permute), and one per row matmul.
A rematerialised block also replays the o ring unless it keeps `o_proj` (save_dots keeps the
chunks' partial dots, not their sum: it replays it), and its input rings, which XLA merges with
the weight gradients' where one backward of one layer runs both (a pipeline stage's loop of
layers and a split schedule's B pass run them apart: `replayed_apart`). With `plan.qat` the
same rings carry 8-bit operands (`quantised`; bytes per ring in `rings`). Same wire bytes and
memory as GSPMD's sequence parallelism; what it buys is that every hop has an independent
partial matmul to hide under, where GSPMD's all-gather must finish before its matmul starts and
its reduce-scatter cannot start before the matmul ends (`experiments/11_overlap.py` measures
both from the scheduled HLO). What it costs: t smaller matmuls in place of one.

`plan.xla_preset` names a set of XLA compiler options for the train step (`XLA_PRESETS`, passed
to `jax.jit(compiler_options=...)`, so no environment flag has to be set before the backend
starts, and the installed jaxlib rejects a misspelled option by name). `xla_gpu_*` options only
act on XLA:GPU; XLA:CPU runs collectives synchronously on its own thread pool and has one
scheduler option (`xla_cpu_enable_concurrency_optimized_scheduler`).
"""
from __future__ import annotations

from jaxscale.hooks import register
from jaxscale.strategies.common import Comm, permutes
from jaxscale.strategies.remat import actions, parse
from jaxscale.strategies.tables.activations import stream_bytes

NAME = "overlap"
AVAILABLE = True
MODES = ("none", "collective_matmul", "collective_matmul_bidirectional")
#: distinct inputs the column-parallel sites gather: the attention norm's and the MLP norm's
INPUT_RINGS = 2

_LHS = {"xla_gpu_enable_latency_hiding_scheduler": True,
        "xla_gpu_enable_highest_priority_async_stream": True,
        "xla_gpu_enable_pipelined_all_gather": True,
        "xla_gpu_enable_pipelined_reduce_scatter": True,
        "xla_gpu_enable_pipelined_all_reduce": True,
        "xla_gpu_enable_while_loop_double_buffering": True,
        "xla_cpu_enable_concurrency_optimized_scheduler": True}
_BUCKET = 256 << 20
#: preset -> XLA compiler options (GPU-only unless `xla_cpu_`)
XLA_PRESETS: dict[str, dict] = {
    # XLA's defaults for the backend
    "default": {},
    # the latency-hiding scheduler (async collectives moved as early / late as their data
    # allows), collectives of the next and previous loop iteration pipelined into this one
    "latency_hiding": dict(_LHS),
    # plus gradient bucketing: collectives combined up to 256 MiB each
    "bucketed": {**_LHS, "xla_gpu_all_reduce_combine_threshold_bytes": _BUCKET,
                 "xla_gpu_all_gather_combine_threshold_bytes": _BUCKET,
                 "xla_gpu_reduce_scatter_combine_threshold_bytes": _BUCKET},
    # no combining: one collective per tensor (to measure what bucketing buys)
    "unbucketed": {"xla_gpu_all_reduce_combine_threshold_bytes": 0,
                   "xla_gpu_all_gather_combine_threshold_bytes": 0,
                   "xla_gpu_reduce_scatter_combine_threshold_bytes": 0},
    # XLA:GPU's own collective matmul: the SPMD partitioner loops all-gather/reduce-scatter
    # einsums into windowed einsums above the threshold (0 MiB: all of them)
    "windowed_einsum": {**_LHS, "xla_gpu_threshold_for_windowed_einsum_mib": 0,
                        "xla_gpu_multi_streamed_windowed_einsum": True},
}


def compiler_options(preset: str) -> dict:
    """The XLA compiler options of a preset (`XLA_PRESETS`); {} for `default`."""
    if preset not in XLA_PRESETS:
        raise ValueError(f"plan.xla_preset={preset!r}: valid are {', '.join(XLA_PRESETS)}")
    return dict(XLA_PRESETS[preset])


def gpu_only(preset: str) -> list[str]:
    """The options of a preset that only XLA:GPU acts on."""
    return [k for k in compiler_options(preset) if k.startswith("xla_gpu_")]


def active(spec) -> bool:
    return spec.tp_overlap != "none"


def bidirectional(spec) -> bool:
    return spec.tp_overlap == "collective_matmul_bidirectional"


def problems(spec) -> list[str]:
    errs = []
    if spec.xla_preset not in XLA_PRESETS:
        errs.append(f"plan.xla_preset={spec.xla_preset!r}: valid are {', '.join(XLA_PRESETS)}")
    if spec.tp_overlap not in MODES:
        errs.append(f"plan.tp_overlap={spec.tp_overlap!r}: valid are {', '.join(MODES)}")
    if not active(spec):
        return errs
    opt = f"plan.tp_overlap={spec.tp_overlap}"
    if spec.deg("tp") == 1:
        errs.append(f"{opt} decomposes the tensor-parallel collectives over mesh.tp, but "
                    f"mesh.tp=1: set mesh.tp > 1, or plan.tp_overlap=none")
    elif not spec.sequence_parallel:
        errs.append(f"{opt} replaces the all-gather / reduce-scatter pairs of Megatron sequence "
                    f"parallelism: set plan.sequence_parallel=true (without it the row-parallel "
                    f"outputs are all-reduced, which no ring of sequence chunks replaces)")
    return errs


def rules(spec, rules) -> None:
    if active(spec):
        for seam in ("projection", "columns"):     # the row sites; the column groups
            rules.set_seam(seam, implementation(spec), by=f"plan.tp_overlap={spec.tp_overlap}")


def rings(spec) -> list[tuple[str, int, float, int]]:
    """The rings of one layer and micro-batch (see the module docstring), as (what, rings,
    bytes per element of a bsh/t chunk, permutes per hop), by `plan.qat`'s operands:

    - plain: forward, one ring per column group's input and one per row-parallel matmul;
      backward, the groups' input rings again for the weight gradients, one reverse ring per
      group for its summed input gradient, one per row matmul; a rematerialised block replays
      the o ring unless it keeps `o_proj` (save_dots keeps the chunks' partial dots, so it
      replays the ring summing them: measured on dp2 x tp4 and in pipeline stages), and its
      groups' input rings, which are the weight gradients' rings only where one backward runs
      both on one layer (`replayed_apart`).
    - int8: forward, the groups' rings carry the int8 chunk and its per-token fp32 scales (two
      permutes per hop), the row rings s32 partial dots; backward, the plain rings; a
      rematerialised block replays its int8 input rings (not the plain ones of dW) and the o
      ring.
    - fp8: the forward input rings and the backward rings of the weight gradients (the same
      ring, replayed) carry e4m3 bytes, the row matmuls' backward rings e5m2 bytes; the
      reduce-scattering rings (row forward, the groups' input gradients) partial dots in the
      compute dtype."""
    c, q = spec.wire_compute_itemsize, spec.qat
    # save_dots keeps each chunk's partial dot, not the o ring's sum: the replay runs the ring
    replay_o = parse(spec.remat) == "save_dots" or (parse(spec.remat) != "none"
                                                    and actions(spec.remat)["o_proj"] == "remat")
    mlp = _dense_mlp(spec)
    n_in = n_row = INPUT_RINGS / 2 * (1 + mlp)
    if q == "int8":
        gather = 1 + 4 / spec.model.dim
        out = [("int8 inputs", n_in, gather, 2), ("s32 row outputs", n_row, 4, 1),
               ("dW inputs", n_in, c, 1), ("input gradients", n_in, c, 1),
               ("row gradients", n_row, c, 1)]
        if parse(spec.remat) != "none":
            out.append(("int8 inputs replayed", n_in, gather, 2))
        return out + ([("o replayed", 1, 4, 1)] if replay_o else [])
    e8 = _e8(spec)
    out = [("inputs", n_in, e8, 1), ("row outputs", n_row, c, 1),
           ("dW inputs", n_in, e8, 1), ("input gradients", n_in, c, 1),
           ("row gradients", n_row, e8, 1)]
    return out + ([("o replayed", 1, c, 1)] if replay_o else [])


def replayed_apart(spec) -> float:
    """Input rings per layer a rematerialised pipeline stage replays beside its weight
    gradients' rings. A block whose remat policy recomputes a column group's outputs (q, k, v;
    gate, up) replays that group's input ring; one backward of one layer shares it with the
    weight gradients' ring (the same permutes of the same chunk, which XLA merges). A split
    schedule (ZB-H1, ZB-V) takes the weight gradients in its W pass, from the tape, so the
    B pass's replay is a ring of its own on every layer; a 1F1B, GPipe or interleaved stage op
    of two or more layers replays its layers in a loop of its own, whose rings XLA does not
    merge with the backward's (measured: ops of one layer share them, 1F1B on pp2 x tp4 with 2
    layers and interleaved with 4; ops of 2 and 3 layers do not: 13 rings per layer where 11
    are needed). None is needed (the minimum shares them); int8's replayed rings are its own
    (`rings`)."""
    from jaxscale.strategies.pp.schedules import SPLIT
    from jaxscale.strategies.pp.stages import counts_or_even
    a = actions(spec.remat)
    groups = (any(a[t] == "remat" for t in ("q_proj", "k_proj", "v_proj"))
              + _dense_mlp(spec) * any(a[t] == "remat" for t in ("mlp_gate", "mlp_up")))
    if spec.deg("pp") == 1 or not groups or spec.qat == "int8":
        return 0.0
    if spec.schedule in SPLIT:
        return float(groups)
    return groups * sum(n for n in counts_or_even(spec) if n >= 2) / spec.model.n_layers


def _dense_mlp(spec) -> float:
    """The share of a layer's rings its MLP runs: a MoE layer's experts run in their own region
    (`strategies/ep/grouped.py`), its shared experts (if any) as a dense MLP."""
    m = spec.model
    return 1.0 - (m.n_moe_layers / m.n_layers if spec.moe and not m.moe_shared_experts else 0.0)


def _e8(spec) -> int:
    """Bytes per element of the rings fp8 carries in e4m3 / e5m2 (else the compute dtype's)."""
    return 1 if spec.qat == "fp8" else spec.wire_compute_itemsize


def collectives(spec) -> list[Comm]:
    if not active(spec) or spec.deg("tp") == 1 or not spec.sequence_parallel:
        return []
    t, L, k = spec.deg("tp"), spec.layers_per_device, max(1, spec.accumulate)
    elements = stream_bytes(spec) / spec.wire_compute_itemsize / t     # one chunk
    hops = (t - 1) * L * k

    def row(found, what, **kw):
        return permutes(spec, "tp", sum(r * b for _, r, b, _ in found) * elements * hops,
                        sum(r * p for _, r, _, p in found) * hops, what + "; per layer "
                        + ", ".join(f"{r:g} {w}" for w, r, _, _ in found), overlap=True, **kw)
    out = [row(rings(spec), "collective matmul: t-1 hops of a bsh/t chunk per ring")]
    if w := w_rings(spec):
        out.append(row(w, "collective matmul under a split schedule's W pass (each matmul's "
                       "own backward, `hooks.projection.weight_grad`)", minimum=0.0))
    if apart := replayed_apart(spec):
        out.append(row([("inputs replayed", apart, _e8(spec), 1)], "collective matmul: a "
                       "pipeline stage's replayed input rings beside its weight gradients'",
                       minimum=0.0))
    return out


def w_rings(spec) -> list[tuple[str, float, float, int]]:
    """The rings a split pipeline schedule's W pass (ZB-H1, ZB-V) runs beyond an unsplit
    backward's, per layer and micro-batch, as `rings`' rows: each weight's gradient is its own
    matmul's backward from the tape (`weight_grad`), replaying that matmul's ring, so each
    column site gathers its input (q, k, v; gate, up: in e4m3 under fp8) where a group
    gathered once, and each row matmul's output-gradient ring runs again (e5m2 under fp8),
    where one ring served both of its backward products. None of them is needed: the minimum
    is the unsplit backward's rings. The W pass reads the tape, so a remat policy replays nothing
    in it (its B pass's replay is `replayed_apart`), and int8 QAT's weight gradients are plain
    matmuls: its W pass runs these same rings in the compute dtype. Measured equal on
    dp2 x pp2 x tp2 ZB-H1 and ZB-V (fp32, fp8, int8 with fp16 and bf16) and pp2 x ep2 x tp2
    ZB-H1 with MoE, with and without full remat."""
    from jaxscale.strategies.pp.schedules import SPLIT
    if spec.deg("pp") == 1 or spec.schedule not in SPLIT:
        return []
    mlp, e8 = _dense_mlp(spec), _e8(spec)
    n_in = INPUT_RINGS / 2 * (1 + mlp)
    return [("dW inputs per site", 3 + 2 * mlp - n_in, e8, 1),
            ("row gradients again", n_in, e8, 1)]


def memory(spec) -> list:
    """Nothing beyond GSPMD's sequence parallelism is kept between forward and backward; the
    backward holds one gathered input (bsh) while it replays its ring for the weight gradients,
    where GSPMD holds the all-gathered one."""
    return []


def label(spec) -> list[str]:
    out = [spec.tp_overlap.replace("_", "-")] if active(spec) else []
    return out + ([f"xla-{spec.xla_preset}"] if spec.xla_preset != "default" else [])


def shape_step(spec, parts) -> None:
    """The step: the XLA compiler options of `plan.xla_preset` (the collective matmuls run
    through the model's projection seam, named in `rules`)."""
    parts.compiler_options.update(compiler_options(spec.xla_preset))


def implementation(spec) -> str:
    """The projection seam's implementation: the collective matmul, on QAT's 8-bit operands
    when `plan.qat` is set (`quantised`)."""
    return spec.tp_overlap + ("" if spec.qat == "none" else f"+{spec.qat}")


def _register(mode: str, quant: str | None):
    name = mode + ("" if quant is None else f"+{quant}")
    bidi = mode.endswith("bidirectional")

    def rings():
        from jaxscale.strategies.overlap import collective_matmul, quantised
        return collective_matmul, (collective_matmul.plain_rings if quant is None
                                    else quantised.RINGS[quant])

    @register("projection", name)
    def run(*args, **kw):
        cm, impl = rings()
        return cm.project(*args, bidirectional=bidi, impl=impl, **kw)

    @register("columns", name)
    def group(*args, **kw):
        cm, impl = rings()
        return cm.project_group(*args, bidirectional=bidi, impl=impl, **kw)


for _mode in MODES[1:]:
    for _quant in (None, "int8", "fp8"):
        _register(_mode, _quant)
