"""Quantisation-aware training: the block's weight matmuls run on 8-bit operands.

`plan.qat=none|int8|fp8` (`plan.fp8_amax_history=16`: delayed scaling over that many steps; 0:
current, just-in-time scaling). The strategy sets the rules' `projection` seam to its
implementation, which `jaxscale.hooks.projection.project` calls for wq, wk, wv, wo, w_gate, w_up and
w_down of every layer; the LM head stays in the compute dtype with fp32 logits (as in the published
fp8 recipes). The numerics are `jaxscale.strategies.qat.numerics`:

- int8: per-channel weights, per-token activations, an s8 x s8 -> s32 dot, rescaled; backward
  straight-through, the unquantised matmul's gradients in the compute dtype. No state.
- fp8: e4m3 x e4m3 forward dot, e5m2 output gradients in both backward dots (fp32 accumulation),
  per-tensor scales. Delayed scaling keeps, per layer, 18 amax histories (the four matmul
  inputs, the seven weights, the seven output gradients) in `TrainState.quant`
  ([layers, 18, history] fp32, replicated, checkpointed with the state); the scale of a step is
  max(history) / fp8 max. After the step, once, its amaxes are rolled in: for each slot the
  largest over the step's micro-batches and over the devices' pieces (a data region's rows, a
  tensor-parallel group's shards), the output gradients' in the whole batch's token-mean units
  (`gradient_unit`), so that the histories are one device's on every layout and restore onto
  any; a skipped step leaves them. A slot without history (the first step) scales each
  micro-batch by its own amax: with plan.accumulate = k the first step rounds differently from
  k = 1, the later steps (the history's scales) do not.

Saves: fp8 keeps each matmul's input for the backward in e4m3, 1 byte per element instead of
the compute dtype's (the attention-input and MLP-input norms' outputs, the attention output and
the MLP hidden: (2d + H hd + f) per token and layer). int8 saves no memory: its straight-through
backward needs the unquantised operands (the int8 copies are temporaries). On hardware with
8-bit matrix units both halve (vs 16-bit) the matmul's operand traffic and double its peak rate;
XLA:CPU runs the s8 dots as integer dots, but widens fp8 dots to f32 after the casts (the
pre-optimisation HLO has the f8e4m3fn / f8e5m2 dots; XLA:GPU on Hopper lowers them to cuBLASLt
fp8 GEMMs). Costs: quantisation error, the amax reductions (one pass over each operand), and for
fp8 the histories (18 x history x 4 bytes per layer).

Collectives: no new kind of traffic, only reductions of scales. An amax or a per-token /
per-channel scale taken over an axis a plan splits becomes an all-reduce(max): int8's per-token
scales of wo's and w_down's inputs, whose contracted heads / mlp axes are split over tp, add one
all-reduce of B T / data-degree fp32 per layer each (forward only: the backward is the plain
one); fp8's per-tensor amaxes are scalar all-reduces. Matmul partial sums under tp move as s32
(int8) or f32 (fp8): 4 bytes per element, as in fp32. Under FSDP (and ZeRO-3) int8 quantises
each weight on its own shard (`on_shards`: the int8 values and the scales constrained to the
weight's layout), so every block weight's forward all-gather moves int8 values, plus its fp32
scales where the gather axes split a channel dimension (wo's and w_down's `embed`), and the
scales of a weight whose contraction they split are first all-reduced (max) over them; the
straight-through backward gathers the weight in the compute dtype (-32% of the tiny model's
gather bytes); a remat replay gathers the int8 operands again (`weight_gathers`, fsdp's formula,
census = formula row by row; its minimum column leaves the replay's out). Under a remat policy
tensor parallelism's column weights reach the projection gathered (`arrives_gathered`) and are
quantised there. fp8 casts each shard to e4m3 the same way (a per-tensor divisor: no scales to
gather), and its backward keeps that shard, so both gathers move e4m3 (f16 on XLA:CPU); under
collective matmul both methods' rings gather the quantised weight (docs/quantization.md).

A mixture of experts' expert matmuls run through the same numerics as grouped matmuls
(`ragged.py`, the rules' `grouped` seam; the plan runs its mixtures as grouped experts), their
scales per expert stack in the dense MLP's slots.

Runs with dp, fsdp, zero, tp (with or without Megatron SP), sp, remat, offload, accumulation,
gradient compression, the sparse embedding exchange, local SGD (inside their data regions the
rules, and so the projection, stay on: `axes.manual`), collective matmul (its rings carry these
operands: `jaxscale.strategies.overlap.quantised`), pipeline stages, mixtures of experts and any
precision.
"""
from __future__ import annotations

import math

from jaxscale.hooks import register
from jaxscale.hooks.projection import plain
from jaxscale.strategies.common import Comm, Term
from jaxscale.strategies.qat.layout import (  # noqa: F401  (fsdp reads weight_gathers)
    QUANTISED_SITES,
    Gathers,
    _quantised,
    arrives_gathered,
    on_shards,
    weight_gathers,
)

NAME = "qat"
AVAILABLE = True
METHODS = ("int8", "fp8")
#: the the rules' `projection` seam implementation of each method
IMPLEMENTATION = {"int8": "qat_int8", "fp8": "qat_fp8"}
#: slots per layer of the fp8 state (`jaxscale.strategies.qat.numerics.SLOTS`: 4 inputs, 7 weights,
#: 7 gradients)
N_SLOTS = 18


def active(spec) -> bool:
    return spec.qat != "none"


def delayed(spec) -> bool:
    """fp8 with an amax history (the state); fp8 with history 0 scales just in time."""
    return spec.qat == "fp8" and spec.fp8_amax_history > 0


def problems(spec) -> list[str]:
    if not active(spec):
        return []
    if spec.qat not in METHODS:
        return [f"plan.qat={spec.qat!r}: valid are none, {', '.join(METHODS)}"]
    errs = []
    if spec.fp8_amax_history < 0:
        errs.append(f"plan.fp8_amax_history={spec.fp8_amax_history} must be >= 0 (0: current "
                    f"scaling)")
    return errs


def rules(spec, rules) -> None:
    """No sharding rule: the projection implementation; under `plan.tp_overlap` the collective
    matmul's, which runs its rings on this method's operands
    (`jaxscale.strategies.overlap.quantised`)."""
    if active(spec) and spec.tp_overlap == "none":
        from jaxscale.axes import MESH_AXES
        # ZeRO-3 splits the stored (stacked) weights over dp too (`layer_entries`)
        stacked = [leaf.shape[0] for leaf in _quantised(spec) if leaf.stacked]
        rules.set_seam("projection", IMPLEMENTATION[spec.qat], by=f"plan.qat={spec.qat}",
                       zero3=spec.zero >= 3 and spec.deg("dp") > 1,
                       sizes=tuple((a, spec.deg(a)) for a in MESH_AXES),
                       layers=stacked[0] if stacked else None)
    if active(spec) and spec.moe:
        rules.set_seam("grouped", IMPLEMENTATION[spec.qat], by=f"plan.qat={spec.qat}")


def collectives(spec) -> list[Comm]:
    """fp8: its scalar amax all-reduces are left out (`validation.scalar_bytes`), but in a data
    region (`common.sync_axes`) the step's amaxes leave it as one [layers, slots] fp32 array,
    combined (max) over the region's axes once per run of it (`dp.region`). int8: under tp: the
    per-token scales of wo's and w_down's inputs, and those weights' per-channel scales, are maxima
    over their contracted axes (heads and mlp), which tp splits: per layer one fp32 all-reduce(max)
    of the local tokens and one of the local channels for each, in the forward. Where a weight is
    quantised on its shards before fsdp's gather (`on_shards`, or collective matmul's ring) and the
    gather axes split its contraction (the column-parallel weights' `embed`): its per-channel scales
    all-reduced (max) over those axes, once per forward run (micro-batch, and remat replay of its
    matmul)."""
    if not active(spec):
        return []
    if spec.qat == "fp8":
        from jaxscale.strategies.common import sync_axes
        from jaxscale.strategies.dp import mean_runs
        region, runs = sync_axes(spec), mean_runs(spec)
        return [Comm("all-reduce", region, 4 * spec.model.n_layers * N_SLOTS * runs, runs,
                     "fp8 QAT: the step's amaxes over the data region (max)",
                     group=math.prod(spec.deg(a) for a in region))] if region else []
    from jaxscale.strategies.qat.layout import int8_scale_collectives
    return int8_scale_collectives(spec)


def saved_input_elements(spec) -> float:
    """Elements per token and layer of the matmul inputs the backward keeps (per device):
    the two norms' outputs (d each), the attention output (H hd) and the MLP hidden (f)."""
    m, t = spec.model, spec.deg("tp")
    res = 2 * m.dim / (t if spec.sequence_parallel else 1)
    return (res + (m.n_heads * m.hd + m.ffn_dim) / t) / spec.deg("sp")


def memory(spec) -> list[Term]:
    """fp8: the amax histories (replicated), and the matmul inputs kept in e4m3 (1 byte) instead
    of the compute dtype for the backward (a negative activation term). int8: none."""
    if not active(spec) or spec.qat != "fp8":
        return []
    out = []
    if delayed(spec):
        out.append(Term("optimizer", 4 * spec.model.n_layers * N_SLOTS * spec.fp8_amax_history,
                        "fp8 amax histories"))
    tokens = spec.micro_batch * spec.seq
    saved = -(spec.compute_itemsize - 1) * tokens * saved_input_elements(spec)
    if spec.remat == "none":
        out.append(Term("activations", saved * spec.model.n_layers,
                        "matmul inputs saved in e4m3 instead of the compute dtype"))
    return out


def label(spec) -> list[str]:
    if not active(spec):
        return []
    if spec.qat == "fp8":
        return [f"qat-fp8({'h' + str(spec.fp8_amax_history) if delayed(spec) else 'current'})"]
    return [f"qat-{spec.qat}"]


# ----------------------------------------------------------------------------- the step side
def shape_step(spec, parts) -> None:
    """The step, for fp8 with delayed scaling: the amax histories in `TrainState.quant`, and a
    probe that gives each layer's matmuls their scales and reads back the amaxes they saw."""
    if not delayed(spec):
        return
    import jax.numpy as jnp

    from jaxscale.strategies.common import Probe
    from jaxscale.strategies.qat import numerics
    unit = gradient_unit(spec)
    parts.set("state.quant", lambda params, optimizer, where: init_state(spec), by=NAME)
    parts.set("probe", Probe("quant", read=lambda st: numerics.scales(st, unit),
                             wrap=numerics.probing, combine=jnp.maximum,
                             write=lambda st, amax, finite: numerics.update_history(
                                 st, amax, finite, unit)), by=NAME)


def gradient_unit(spec) -> int:
    """How much larger the output gradients the fp8 matmuls see are than one device's: the
    grads function differentiates the token sum over its rows' slots, so inside a data region
    (`common.sync_axes`; local SGD's replicas over dp) by the region's data degree."""
    from jaxscale.strategies import common
    return math.prod(spec.deg(a) for a in common.manual_data_axes(spec))


def init_state(spec):
    """fp8 delayed scaling's {"amax_history": [layers, slots, history]} (zeros), else None."""
    if not delayed(spec):
        return None
    from jaxscale.strategies.qat import numerics
    return numerics.init_history(spec.model.n_layers, spec.fp8_amax_history)


@register("projection", IMPLEMENTATION["int8"])
def _int8(eq, x, w, site, names, mesh, rules, **kw):
    if site not in QUANTISED_SITES:
        return plain(eq, x, w, **kw)
    from jaxscale.strategies.qat import numerics
    w_q = numerics.int8_weight(eq, w)
    if not arrives_gathered(site, rules):
        w_q = on_shards(eq, w_q, site, names[1], rules)
    return numerics.int8_matmul(eq, x, w, w_q)


@register("projection", IMPLEMENTATION["fp8"])
def _fp8(eq, x, w, site, names, mesh, rules, **kw):
    if site not in QUANTISED_SITES:
        return plain(eq, x, w, **kw)
    from jaxscale.hooks.projection import layer_cache, layer_input
    from jaxscale.strategies.qat import numerics
    layer = layer_input()          # this layer's [slots] divisors (delayed scaling), or None
    scales = None if layer is None else numerics.site_scales(layer, site)
    cache, group = layer_cache(), numerics.INPUT[site]
    hit = cache.get(group) if cache is not None else None
    if hit is not None and hit[0] is x:       # k, v after q; up after gate: one e4m3 input
        x_q = hit[1]
    else:
        x_q = numerics.quantize_input(x, None if scales is None else scales[0])
        if cache is not None:
            cache[group] = (x, x_q)
    w_q = numerics.quantize_weight(w, None if scales is None else scales[1])
    if not arrives_gathered(site, rules):
        w_q = on_shards(eq, w_q, site, names[1], rules)
    return numerics.fp8_matmul(eq, x, w, scales, record_x=site in numerics.RECORDS_INPUT,
                               x_q=x_q, w_q=w_q)


@register("grouped", IMPLEMENTATION["int8"])
def _int8_grouped(xs, w, sizes, site, mesh, rules):
    from jaxscale.strategies.qat.ragged import int8_grouped
    # the down projection contracts `mlp`, split over tp in the experts' region
    return int8_grouped(xs, w, sizes, rules.manual.get("mlp", ()) if site == "w_down" else ())


@register("grouped", IMPLEMENTATION["fp8"])
def _fp8_grouped(xs, w, sizes, site, mesh, rules):
    from jaxscale.hooks.projection import layer_input
    from jaxscale.strategies.qat import numerics
    from jaxscale.strategies.qat.ragged import fp8_grouped
    layer = layer_input()
    scales = None if layer is None else numerics.site_scales(layer, site)
    return fp8_grouped(xs, w, sizes, scales, record_x=site in numerics.RECORDS_INPUT)
