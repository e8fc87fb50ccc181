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
  max(history) / fp8 max, and the amaxes the step saw are rolled in after it (mean over the
  micro-batches with plan.accumulate > 1; a skipped step leaves them). A slot without history
  (the first step) scales by its own amax.

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
(int8) or f32 (fp8): 4 bytes per element, as in fp32. What changes in byte counts: under FSDP
XLA quantises each weight shard before the forward all-gather, so the block weights travel in
8 bits (int8: forward only, -32% of the tiny model's gather bytes; fp8: both passes, widened to
f16 by XLA:CPU, -43%); `fsdp`'s formula models it where the code decides it, under collective
matmul (`ring_gathers`: the ring's region gathers the quantised weight), not for GSPMD's own
choice (docs/quantization.md).

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
from jaxscale.strategies.tables.activations import exchange

NAME = "qat"
AVAILABLE = True
METHODS = ("int8", "fp8")
#: the the rules' `projection` seam implementation of each method
IMPLEMENTATION = {"int8": "qat_int8", "fp8": "qat_fp8"}
#: slots per layer of the fp8 state (`jaxscale.strategies.qat.numerics.SLOTS`: 4 inputs, 7 weights,
#: 7 gradients)
N_SLOTS = 18
QUANTISED_SITES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


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
        rules.set_seam("projection", IMPLEMENTATION[spec.qat], by=f"plan.qat={spec.qat}")
    if active(spec) and spec.moe:
        rules.set_seam("grouped", IMPLEMENTATION[spec.qat], by=f"plan.qat={spec.qat}")


def collectives(spec) -> list[Comm]:
    """int8 under tp: the per-token scales of wo's and w_down's inputs, and those weights'
    per-channel scales, are maxima over their contracted axes (heads and mlp), which tp splits:
    per layer one fp32 all-reduce(max) of the local tokens and one of the local channels for
    each, in the forward. (Scalar amax all-reduces are left out.)"""
    if not active(spec) or spec.qat != "int8" or spec.deg("tp") == 1:
        return []
    L, t = spec.model.n_layers, spec.deg("tp")
    n = 2 * L
    tokens = spec.local_batch * spec.local_seq
    down = L * tokens
    if spec.moe:        # a MoE layer's w_down reads the grouped experts' rows (ep/grouped.py)
        Lm = spec.model.n_moe_layers
        down += Lm * (exchange(spec).rows * max(1, spec.accumulate) - tokens)
    weights = _quantised(spec)
    rows = [leaf for leaf in weights if _split_by(spec, leaf, True, "tp")]      # wo, w_down
    out = [Comm("all-reduce", ("tp",), 4 * (tokens * L + down), n,
                "int8 QAT: per-token scales of wo and w_down inputs (max)", group=t),
           Comm("all-reduce", ("tp",), 4 * sum(_channels(spec, x) for x in rows), n,
                "int8 QAT: per-channel scales of wo and w_down (max)", group=t)]
    f = spec.deg("fsdp")
    if f > 1 and spec.tp_overlap != "none":
        # the weights quantised before the ring's region gathers them: a channel's scale is a
        # max over its contraction, which fsdp splits for the column-parallel weights
        split = [leaf for leaf in weights if _split_by(spec, leaf, True, "fsdp")]
        if split:
            out.append(Comm("all-reduce", ("fsdp",), 4 * sum(_channels(spec, x) for x in split),
                            L, "int8 QAT: per-channel scales of weights whose contraction fsdp "
                            "splits (max), before the ring's gather", group=f))
    return out


def _quantised(spec) -> list:
    """The block weights this strategy quantises (`QUANTISED_SITES`), as parameter leaves."""
    from jaxscale.strategies.tables.params import leaves
    return [leaf for leaf in leaves(spec.model) if leaf.path.split("/")[-1] in QUANTISED_SITES]


def _contracted(leaf, contracted: bool) -> list[int]:
    """A weight's contracted dimensions (its input: `tables.params.contracted_axes`), or the
    others (its channels, those of its per-channel scales; the layers axis left out)."""
    from jaxscale.strategies.tables.params import STACKED, contracted_axes
    into = contracted_axes(leaf.axes)
    return [d for d, ax in enumerate(leaf.axes)
            if ax not in STACKED and (d in into) == contracted]


def _channels(spec, leaf, drop=()) -> float:
    """Local elements of a weight's per-channel scales, over all its layers."""
    shape = leaf.local_shape(spec, drop)
    return float(math.prod(shape[d] for d, ax in enumerate(leaf.axes)
                           if d not in _contracted(leaf, True)))


def _split_by(spec, leaf, contracted: bool, mesh_axis: str) -> bool:
    """Whether `mesh_axis` splits the weight's contracted (or channel) dimensions."""
    return any(mesh_axis in spec.rules.table.get(leaf.axes[d], ())
               for d in _contracted(leaf, contracted))


def ring_gathers(spec, leaf) -> tuple[float, float] | None:
    """(forward, backward) bytes of fsdp's all-gather of a block weight when collective matmul
    runs on QAT's operands (`overlap.quantised`: the region gathers the weight already quantised):
    forward 1 byte per element (int8 with its per-channel fp32 scales where fsdp splits a channel
    dimension); backward fp8's e4m3 again, int8's straight-through backward the compute dtype.
    None for any other leaf or plan (the compute dtype, `fsdp.collectives`)."""
    if (not active(spec) or spec.tp_overlap == "none"
            or leaf.path.split("/")[-1] not in QUANTISED_SITES):
        return None
    elements = leaf.run_size(spec, drop=("fsdp",))
    if spec.qat == "fp8":
        return elements, elements
    scales = 4 * _channels(spec, leaf, ("fsdp",)) if _split_by(spec, leaf, False, "fsdp") else 0
    return elements + scales, elements * spec.wire_param_itemsize


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
    parts.set("state.quant", lambda params, optimizer, where: init_state(spec), by=NAME)
    parts.set("probe", Probe("quant", read=numerics.scales, wrap=numerics.probing,
                             combine=jnp.maximum, write=numerics.update_history), by=NAME)


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
    return numerics.int8_matmul(eq, x, w)


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
    return numerics.fp8_matmul(eq, x, w, scales, record_x=site in numerics.RECORDS_INPUT, x_q=x_q)


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
