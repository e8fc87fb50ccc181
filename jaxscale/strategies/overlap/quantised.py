"""Collective matmul on 8-bit operands: `plan.tp_overlap` with `plan.qat`.

The same rings as `collective_matmul` (t-1 `ppermute` hops per ring, each overlapping one partial
matmul), on the operands of the QAT numerics (`jaxscale.strategies.qat.numerics`) instead of the
compute dtype's. Each operand is quantised once, outside the ring, on the whole (GSPMD) array, as
the one-device QAT step quantises it: so the scales are the one device's (a per-token scale of a
contraction split over tp, a per-tensor amax, are maxima GSPMD reduces across devices), and what
travels round the ring is already 8-bit.

- int8 (per-token x, per-channel w, straight-through backward):
  - column (all-gather) sites: the ring carries the int8 chunk of x and its fp32 per-token scales
    (1 + 4/d bytes per element instead of the compute dtype's); each hop's s8 x s8 -> s32 dot is
    rescaled where it lands;
  - row (reduce-scatter) sites: the accumulators travel as s32 partial dots (4 bytes per
    element), summed exactly, rescaled once by the chunk's owner: the one device's int8 matmul
    bit for bit;
  - backward: the plain collective matmul's (the unquantised operands' gradients in the compute
    dtype), as `numerics.int8_matmul`'s straight-through one.
- fp8 (per-tensor scales, delayed from `TrainState.quant`'s history or just in time; e4m3
  forward, e5m2 output gradients backward, fp32 accumulation), as `numerics.fp8_matmul`:
  - column: forward, a ring of e4m3 chunks of x (1 byte per element); backward, dx as a
    reduce-scatter ring of fp32 partial dots of the e5m2 gradient with w, dw as a ring of the
    e4m3 chunks again, each contracted with its slice of the gradient;
  - row: forward, a reduce-scatter ring of fp32 partial dots; backward, one ring of e5m2
    gradient chunks giving dx (placed) and dw (contracted);
  - the amaxes seen are the cotangent of the site's scales, as in `numerics`.

The column sites of a group (q, k, v; gate, up) share one ring of x's chunks, as in the plain
collective matmul. Collectives: the plain collective matmul's rings, at the bytes
`overlap.rings` gives (int8's gathering rings two permutes per hop: the chunk and its scales;
with remat, int8 replays its 8-bit input rings, which are not the plain ones its straight-through
backward runs); the per-token scales of row sites' inputs and the weights' per-channel scales
(int8), the amaxes (fp8), are all-reduce(max)es GSPMD runs as it does without the ring.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxscale.axes import MESH_AXES, entry_axes
from jaxscale.strategies.dp.region import scatter_or_sum
from jaxscale.strategies.overlap.collective_matmul import (
    allgather_contract,
    allgather_matmul,
    matmul_reduce_scatter,
    plain_rings,
    region,
    ring_gather,
    specs,
    take_chunk,
)
from jaxscale.strategies.qat import numerics


def _contracted_free(spec: tuple, dims) -> P:
    """A scale's spec: the operand's, None on the contracted (size-1) dimensions."""
    return P(*(None if d in dims else e for d, e in enumerate(spec)))


# ----------------------------------------------------------------------------- int8
def int8_rings(rings, eq: str, x, ws, sites) -> tuple:
    """The group's matmuls through its ring on int8 operands (the module docstring); the
    backward straight-through, the plain ring's."""
    r = rings[0]
    cx, cw, _ = numerics._dims(eq)
    ring_kw = dict(x_seq=r.x_seq, out_seq=r.out_seq, bidirectional=r.bidirectional)
    x_spec, w_specs, o_specs = specs(rings)
    sx_spec = _contracted_free(r.x_spec, cx)
    sw_specs = tuple(_contracted_free(q.w_spec, cw) for q in rings)

    def forward(x, *ws):
        qx, sx = numerics._int8(x, cx)
        qws = [numerics._int8(w, cw) for w in ws]

        def body(qx, sx, *qws):
            qws = [(q.gather_weight(a), q.gather_weight(b, skip=cw))
                   for q, (a, b) in zip(rings, zip(qws[::2], qws[1::2]))]
            if r.column:         # the int8 chunk and its per-token scales travel
                return allgather_matmul(eq, (qx, sx), None, "tp", **ring_kw, matmul=lambda c: tuple(
                    numerics.int8_rescale(eq, numerics.int8_product(eq, c[0], qw), c[1], sw,
                                          x.dtype) for qw, sw in qws))
            # s32 partial dots travel; the owner rescales its summed chunk once
            (qw, sw), = qws
            y = matmul_reduce_scatter(eq, qx, None, "tp", **ring_kw,
                                      matmul=lambda sl: numerics.int8_product(eq, sl, qw))
            mine = take_chunk(sx, lax.axis_index("tp"), y.shape[r.out_seq], r.x_seq)
            return (numerics.int8_rescale(eq, y, mine, sw, x.dtype),)
        in_specs = (x_spec, sx_spec) + tuple(a for pair in zip(w_specs, sw_specs) for a in pair)
        return region(rings, body, in_specs, o_specs)(
            qx, sx, *(a for pair in qws for a in pair))

    @jax.custom_vjp
    def run(x, *ws):
        return forward(x, *ws)

    def fwd(x, *ws):
        return forward(x, *ws), (x, ws)

    def bwd(res, gs):           # straight-through: the plain ring's gradients
        x, ws = res
        return jax.vjp(lambda a, *b: plain_rings(rings, eq, a, b), x, *ws)[1](gs)

    run.defvjp(fwd, bwd)
    return run(x, *ws)


# ----------------------------------------------------------------------------- fp8
def _bytes(a):
    return lax.bitcast_convert_type(a, jnp.uint8)


def _as(a, dtype):
    return lax.bitcast_convert_type(a, dtype)


def _reduce_weight_grad(ring, dw):
    """The local weight gradient (over this device's batch rows) summed over the data axes x is
    split on, reduce-scattered back to the weight's shards over those it was gathered on (the
    data region's `scatter_or_sum`, every axis manual here). Those are batch axes (fsdp,
    ZeRO-3's dp), which split x too."""
    split = tuple(a for a in MESH_AXES if a != "tp" and any(a in entry_axes(e)
                                                           for e in ring.x_spec))
    shards = dict(ring.gathered)
    if not {a for axes in shards.values() for a in axes} <= set(split):
        raise ValueError(f"collective matmul: a weight gathered over {ring.gathered} whose input "
                         f"{ring.x_spec} is whole over those axes")
    spec = P(*(shards.get(d) for d in range(dw.ndim)))
    return scatter_or_sum(dw, spec, split, MESH_AXES)


def fp8_rings(rings, eq: str, x, ws, sites) -> tuple:
    """The group's matmuls through its ring on e4m3 operands, their backward on e5m2 gradients
    (the module docstring); each site's scales from its layer's row of the amax histories (or
    just in time), the amaxes seen their cotangent."""
    from jaxscale.hooks.projection import layer_input
    r = rings[0]
    layer = layer_input()         # this layer's [slots] divisors (delayed scaling), or None
    scales = tuple(jnp.zeros((3,), jnp.float32) if layer is None
                   else numerics.site_scales(layer, s) for s in sites)
    record_x = sites[0] in numerics.RECORDS_INPUT    # the group's first site records x's amax
    dx_eq, dw_eq = numerics._swap(eq)
    bidi = r.bidirectional
    f32, E4, E5 = jnp.float32, numerics.E4M3, numerics.E5M2
    x_spec, w_specs, o_specs = specs(rings)
    one = P()

    def weights(ws, scales):
        aws = [numerics._amax(w) for w in ws]
        sws = [numerics._scale(s[1], a, numerics.FP8_MAX["w"]) for s, a in zip(scales, aws)]
        return aws, sws, [numerics._cast(w, s, E4) for w, s in zip(ws, sws)]

    def forward(x, ws, scales):
        x8, sx, ax = numerics.quantize_input(x, scales[0][0])
        aws, sws, w8s = weights(ws, scales)

        def body(x8, *args):
            w8s, ss = args[:len(rings)], args[len(rings):]
            w8s = [_as(q.gather_weight(_bytes(w)), E4) for q, w in zip(rings, w8s)]
            if r.column:         # e4m3 chunks travel (as bytes: XLA:CPU would widen f8)
                return allgather_matmul(
                    eq, _bytes(x8), None, "tp", x_seq=r.x_seq, out_seq=r.out_seq,
                    bidirectional=bidi, matmul=lambda c: tuple(
                        (numerics._dot(eq, _as(c, E4), w, f32) * s).astype(x.dtype)
                        for w, s in zip(w8s, ss)))
            # partial dots travel, scaled, in the compute dtype
            return (matmul_reduce_scatter(
                eq, x8, None, "tp", x_seq=r.x_seq, out_seq=r.out_seq, bidirectional=bidi,
                matmul=lambda a: (numerics._dot(eq, a, w8s[0], f32) * ss[0]).astype(x.dtype)),)
        ys = region(rings, body, (x_spec,) + w_specs + (one,) * len(rings), o_specs)(
            x8, *w8s, *(sx * s for s in sws))
        res = (x8, ws, sx, sws, tuple(s[2] for s in scales), ax if record_x else 0.0 * ax,
               aws, jnp.zeros((0,), x.dtype))
        return ys, res

    def bwd(res, gs):
        x8, ws, sx, sws, given_g, ax, aws, x_dtype = res
        dt = x_dtype.dtype
        ags = [numerics._amax(g) for g in gs]
        sgs = [numerics._scale(s, a, numerics.FP8_MAX["g"]) for s, a in zip(given_g, ags)]
        g8s = [numerics._cast(g, s, E5) for g, s in zip(gs, sgs)]
        w8s = [numerics._cast(w, s, E4) for w, s in zip(ws, sws)]
        n = len(rings)

        def body(x8, *args):
            g8s, w8s, s_dx, s_dw = (args[:n], args[n:2 * n], args[2 * n:3 * n],
                                    args[3 * n:])
            w8s = [_as(q.gather_weight(_bytes(w)), E4) for q, w in zip(rings, w8s)]
            if r.column:
                # dx: the group's partial input gradients summed, then one reduce-scatter
                # ring back to x's chunks (in the compute dtype); dw: x's e4m3 chunks round
                # the ring again, each against the gradients' slices
                dx = matmul_reduce_scatter(
                    dx_eq, tuple(g8s), None, "tp", x_seq=r.out_seq, out_seq=r.x_seq,
                    bidirectional=bidi, matmul=lambda gsl: sum(
                        numerics._dot(dx_eq, g, w, f32) * s
                        for g, w, s in zip(gsl, w8s, s_dx)).astype(dt))
                dws = allgather_contract(_bytes(x8), tuple(g8s), "tp", lambda c, gsl: tuple(
                    numerics._dot(dw_eq, _as(c, E4), g, f32) for g in gsl), seq=r.out_seq,
                    bidirectional=bidi)
            else:
                # one ring of e5m2 gradient chunks (as bytes): dx placed, dw contracted
                dx, dw = ring_gather(
                    _bytes(g8s[0]), "tp", bidirectional=bidi, out_seq=r.x_seq,
                    place=lambda c: (numerics._dot(dx_eq, _as(c, E5), w8s[0], f32)
                                     * s_dx[0]).astype(dt),
                    contract=lambda c, xs: numerics._dot(dw_eq, xs, _as(c, E5), f32),
                    full=x8, seq=r.x_seq)
                dws = (dw,)
            return (dx,) + tuple(_reduce_weight_grad(q, d * s).astype(w.dtype)
                                 for q, d, s, w in zip(rings, dws, s_dw, ws))
        out = region(rings, body, (x_spec,) + o_specs + w_specs + (one,) * (2 * n),
                     (x_spec,) + w_specs)(
            x8, *g8s, *w8s, *(g * w for g, w in zip(sgs, sws)), *(sx * g for g in sgs))
        amaxes = tuple(jnp.stack([ax if i == 0 else 0.0 * ax, aw, ag])
                       for i, (aw, ag) in enumerate(zip(aws, ags)))
        return out[0], tuple(out[1:]), amaxes

    @jax.custom_vjp
    def run(x, ws, scales):
        return forward(x, ws, scales)[0]

    run.defvjp(forward, bwd)
    return run(x, tuple(ws), scales)


#: plan.qat method -> its collective matmul
RINGS = {"int8": int8_rings, "fp8": fp8_rings}
