"""ZeRO++ on the model's weight matmuls: the `gather` seam's implementation (see `__init__.py`).

Every weight matmul `einsum(eq, x, w)` of a plan with ZeRO++ runs as one custom VJP around the
projection the plan would run anyway (`hooks.projection.compute`: plain, or QAT's 8-bit one):

- forward: the weight's shard gathered whole over the gather axes (fsdp, and dp under ZeRO-3) by
  explicit all-gathers in `jax.shard_map`: quantised in blocks first (qwZ: int8; fp8 parameter
  gather: e4m3), each block's fp32 scale gathered beside it; with hpZ first over the cross-node
  axes, that result (the node's secondary partition) kept for the backward, then over the
  node-local axes;
- backward: the weight gathered again (qwZ: quantised again; hpZ: from the secondary partition,
  over the node-local axes only), the projection's own backward for the input (and fp8 QAT's
  scales); the weight's gradient reduced by XLA as for any sharded weight, or with qgZ by
  quantised all-to-alls in a region manual over the gather axes, node-local axes first, then
  across nodes, each stage dequantising and summing in fp32 and quantising its partial sum again.

The gathered dimension (the one the gather axes split) is reshaped into one sub-dimension per
mesh axis, [n_a, n_b, ..., rest], so that any subset of the axes is gathered into a layout a
`PartitionSpec` can say (hpZ's secondary partition is whole over the cross-node axes only). The
straight-through estimator carries the gradient through the quantisation, as ZeRO++ does.
Quantised blocks run along the last dimension, each of its pieces (its tp shards) zero-padded to
whole blocks and cut back after the gather or the exchange (`quantise`, `unpad`).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxscale.axes import entry_axes, manual, mesh_entry, on_shards
from jaxscale.hooks.projection import SCALES, compute, layer_input, own_layer
from jaxscale.strategies.codecs import decode, encode
from jaxscale.strategies.common import block_size


class Layout:
    """A weight's layout under the plan, and its gathered dimension split per mesh axis."""

    def __init__(self, w_shape, spec, axes, sizes):
        entries = list(spec) + [None] * (len(w_shape) - len(spec))
        dims = [d for d, e in enumerate(entries) if set(entry_axes(e)) & set(axes)]
        if len(dims) != 1:
            raise ValueError(f"ZeRO++ gathers a weight over {axes} on one dimension; a weight "
                             f"of shape {tuple(w_shape)} is laid out {tuple(entries)}")
        self.dim, self.shape, self.sizes = dims[0], tuple(w_shape), sizes
        own = entry_axes(entries[self.dim])
        self.axes = tuple(a for a in own if a in axes)          # in the entry's (major) order
        other = tuple(a for a in own if a not in axes)
        if other:
            raise ValueError(f"ZeRO++ gathers {self.axes} on a dimension also split over {other}")
        n = math.prod(sizes[a] for a in self.axes)
        rest = w_shape[self.dim] // n
        self.split = (self.shape[:self.dim] + tuple(sizes[a] for a in self.axes) + (rest,)
                      + self.shape[self.dim + 1:])
        self.entries = (entries[:self.dim] + list(self.axes) + [None] + entries[self.dim + 1:])

    def pos(self, axis: str) -> int:
        return self.dim + self.axes.index(axis)

    def spec(self, gone=(), ndim=None) -> P:
        """The split array's spec with the axes `gone` gathered (one more trailing None per
        extra dimension: a quantised payload's blocks)."""
        out = [None if e in gone else e for e in self.entries]
        return P(*(out + [None] * ((ndim or len(out)) - len(out))))

    def last_local(self) -> int:
        return self.split[-1] // self.parts()

    def parts(self) -> int:
        """The pieces the split array's last dimension is in here (the axes GSPMD splits it
        over: tp's vocabulary shards of the LM head); each is quantised on its own."""
        return math.prod(self.sizes[a] for a in entry_axes(self.entries[-1]))


def quantise(x, fmt: str, block: int, parts: int = 1):
    """(payload [..., parts, blocks, bytes per block], scales [..., parts, blocks]) of `x` in
    blocks along its last dimension, taken as `parts` pieces (its shards), each zero-padded to
    whole blocks; None scales: no quantising."""
    if fmt in ("", "none"):
        return x, None
    n = x.shape[-1] // parts
    blocks = -(-n // block)
    x = x.astype(jnp.float32).reshape(x.shape[:-1] + (parts, n))
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, blocks * block - n)])
    return encode(fmt, x.reshape(x.shape[:-1] + (blocks, block)))


def unpad(v, n: int):
    """Decoded blocks [..., parts, blocks, block] back to rows [..., parts * n] (padding cut)."""
    v = v.reshape(v.shape[:-2] + (-1,))[..., :n]
    return v.reshape(v.shape[:-2] + (-1,))


def dequantise(payload, scales, fmt: str, shape, dtype, n: int):
    """The weight of `shape` from its gathered blocks; `n`: a piece's row length."""
    if scales is None:
        return payload.reshape(shape)
    return unpad(decode(fmt, payload, scales), n).reshape(shape).astype(dtype)


def gather_stage(tree, lay: Layout, held, axes, mesh):
    """All-gather `tree` (the split weight, or its payload and scales) over `axes`, given the
    axes `held` already gathered: explicit collectives on each device's shard."""
    if not axes:
        return tree

    first = lay.pos(axes[0])
    assert [lay.pos(a) for a in axes] == list(range(first, first + len(axes))), axes

    def one(v):
        """One all-gather over all of `axes` (their sub-dimensions, each 1 here, merged)."""
        shape = v.shape
        v = v.reshape(shape[:first] + (-1,) + shape[first + len(axes):])
        v = jax.lax.all_gather(v, mesh_entry(axes), axis=first, tiled=True)
        return v.reshape(shape[:first] + tuple(lay.sizes[a] for a in axes)
                         + shape[first + len(axes):])

    def body(t):
        return jax.tree.map(one, t)
    specs = jax.tree.map(lambda v: lay.spec(held, v.ndim), tree)
    outs = jax.tree.map(lambda v: lay.spec(tuple(held) + tuple(axes), v.ndim), tree)
    return jax.shard_map(body, mesh=mesh, in_specs=(specs,), out_specs=outs,
                         check_vma=False)(tree)


def reduce_stage(g, lay: Layout, fmt: str, block: int, axes, summed, spec: P):
    """The sum of `g` (a device's partial gradient, split layout, whole over `axes`) scattered
    over `axes`, one axis at a time: quantised, exchanged by all-to-all (each peer its slice),
    dequantised and summed in fp32; then summed over the other axes that hold partial sums
    (`summed`: data axes that do not split the weight, the sequence shards), at the shard's size,
    exactly (inside a region manual over all of them; `spec`: the layout over the axes GSPMD
    still handles)."""
    def body(v):
        for a in axes:
            p, n = lay.pos(a), v.shape[-1]
            q, s = quantise(v, fmt, block)          # [..., 1, blocks, bytes]: a device's rows
            q = jax.lax.all_to_all(q, a, p, p, tiled=True)
            s = jax.lax.all_to_all(s, a, p, p, tiled=True)
            v = jnp.sum(unpad(decode(fmt, q, s), n), axis=p, keepdims=True)
        return jax.lax.psum(v, tuple(summed)) if summed else v
    return on_shards(body, g.astype(jnp.float32), spec)


def matmul(eq, x, w, site, names, mesh, rules, **kw):
    """The `gather` seam: einsum(eq, x, w) with w gathered and reduced as the plan's ZeRO++ parts
    say (`rules.options["gather"]`)."""
    opt = rules.options["gather"]
    sizes = dict(opt["sizes"])
    manual_now = set(sizes) - set(_free_axes(mesh))
    axes = tuple(a for a in opt["axes"] if a not in manual_now)
    spec = rules.spec(names[1])
    if opt["zero3"] and "dp" in axes:
        from jaxscale.strategies.zero import shard_spec
        spec = shard_spec(spec, w.shape, sizes, 3)
    present = {a for e in spec for a in entry_axes(e)}
    axes = tuple(a for a in axes if a in present)
    if not axes:
        return compute(eq, x, w, site, names, **kw)
    lay = Layout(w.shape, spec, axes, sizes)
    fmt, rfmt = opt["weights"], opt["grads"]
    qblock = block_size(lay.last_local(), opt["block"])
    rblock = block_size(lay.last_local(), opt["block"], even=rfmt == "int4")
    nodes = tuple(a for a in lay.axes if a in opt["cross"])       # the axes across nodes
    cross = nodes if opt["hpz"] else ()
    local = tuple(a for a in lay.axes if a not in cross)

    def first(w):
        """The weight's payload gathered over the cross-node axes (hpZ's secondary partition),
        or not gathered at all."""
        tree = quantise(w.reshape(lay.split), fmt, qblock, lay.parts())
        return gather_stage(tree, lay, (), cross, mesh)

    def last(tree):
        tree = gather_stage(tree, lay, cross, local, mesh)
        return dequantise(*tree, fmt, lay.shape, w.dtype, lay.last_local())

    def inner(x, wf, sc):
        with own_layer(sc):
            return compute(eq, x, wf, site, names, **kw)

    @jax.custom_vjp
    def f(x, w, sc):
        return inner(x, last(first(w)), sc)

    def fwd(x, w, sc):
        kept = first(w) if cross else w
        wf = last(kept if cross else first(w))
        return inner(x, wf, sc), (x, kept, sc)

    def bwd(res, dy):
        x, kept, sc = res
        wf = last(kept if cross else first(kept))
        _, back = jax.vjp(inner, x, wf, sc)
        dx, dw, dsc = back(dy)
        if rfmt not in ("", "none"):
            dw = _reduced(x, wf, sc, dy, lay, rfmt, rblock, nodes, rules, names, inner, mesh)
        return dx, dw, dsc

    f.defvjp(fwd, bwd)
    return f(x, w, layer_input(SCALES))


def _reduced(x, wf, sc, dy, lay, fmt, block, nodes, rules, names, inner, mesh):
    """The weight's gradient with qgZ: each device's partial sum over its rows, in a region
    manual over every axis that holds partial sums (the gather axes, the other data axes, the
    sequence shards), scattered over the gather axes node-local first, then across, and summed
    over the others at the shard's size."""
    axes = lay.axes
    x_spec, y_spec = rules.spec(names[0]), rules.spec(names[2])
    own = {a for e in lay.spec() for a in entry_axes(e)} - set(axes)       # tp, ep, ...
    summed = tuple(a for a in _free_axes(mesh) if a not in axes and a not in own
                   and any(a in entry_axes(e) for e in x_spec))
    region = tuple(a for a in _free_axes(mesh) if a in axes or a in summed)

    def only(sp, ndim):
        return P(*[mesh_entry([a for a in entry_axes(e) if a in region])
                   for e in list(sp) + [None] * (ndim - len(sp))])

    def body(x, wf, sc, dy):
        with manual(region):
            _, back = jax.vjp(lambda w: inner(x, w, sc), wf)
            g = back(dy)[0].reshape(lay.split)
            rest = P(*[mesh_entry([a for a in entry_axes(e) if a not in region])
                       for e in lay.spec(axes)])
            order = tuple(a for a in axes if a not in nodes) + tuple(a for a in axes
                                                                     if a in nodes)
            return reduce_stage(g, lay, fmt, block, order, summed, rest).astype(wf.dtype)
    out = jax.shard_map(body, mesh=mesh, axis_names=set(region), check_vma=False,
                        in_specs=(only(x_spec, x.ndim), P(), P(), only(y_spec, dy.ndim)),
                        out_specs=only(lay.spec(), len(lay.split)))(x, wf, sc, dy)
    return out.reshape(lay.shape)


def _free_axes(mesh) -> tuple[str, ...]:
    """The mesh axes not manual here (inside a region, its abstract mesh's auto axes)."""
    types = getattr(mesh, "axis_types", None)
    if types is None:
        return tuple(mesh.axis_names)
    return tuple(a for a, t in zip(mesh.axis_names, types)
                 if t != jax.sharding.AxisType.Manual)
