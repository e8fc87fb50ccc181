"""The model's weight matmuls, through one hook a plan can replace.

Every matmul of an activation with a weight in `models/llama.py` (q, k, v, o, gate, up, down and
the LM head) calls `project(eq, x, w, site, names)`: `eq` is the einsum, `site` the weight's name
(`SITES`) and `names` the logical axes of x, w and the output. Outside a plan, or when the active
rules name no implementation for the `projection` seam, it is `einsum(eq, x, w.astype(x.dtype))`
(`plain`). A strategy that changes how the matmuls run (tensor-parallel matmuls overlapped with
their collectives, 8-bit quantisation-aware training) registers an implementation
`fn(eq, x, w, site, names, mesh, rules, **kw)` with `jaxscale.hooks.register("projection", name)`
and names it in its `rules`; the model itself never learns which one runs. A matmul reading or
writing the residual stream (`norm_seq` in its input's or output's names) goes first through
the `stream` seam, `fn(eq, x, w, site, names, mesh, rules, inner)`, which may run `inner(x, w)`
(the weight's `gather` seam, then `projection`) on other operands, in a region of its own.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Callable

from jaxscale.hooks import implementation

#: the weight matmuls of a block, then the LM head
SITES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "shared_gate", "shared_up",
         "shared_down", "head")


def plain(eq: str, x, w, **kw):
    import jax.numpy as jnp
    return jnp.einsum(eq, x, w.astype(x.dtype), **kw)


def project(eq: str, x, w, site: str, names: tuple[tuple, tuple, tuple], **kw):
    """einsum(eq, x, w) by the active plan's implementation; `kw` (e.g.
    `preferred_element_type`) goes to the einsum. Under `taps` the input and the output gradient
    come out as the taps' cotangents."""
    if _INSIDE.get():
        return _project(eq, x, w, site, names, **kw)
    taps = _taps()
    with _inside():
        y = _project(eq, x if taps is None else _expose(x, taps["x"][site]), w, site, names,
                     **kw)
    _record(site, site, eq, names, x, y)
    return y if taps is None else _catch(y, taps["y"][site])


def project_grouped(xs_RD, w_EDF, sizes_E, site: str):
    """`jax.lax.ragged_dot(xs, w, sizes)`: rows grouped by expert (`sizes` each, in expert
    order) times each expert's weight, a mixture of experts' expert matmul at `site` (w_gate,
    w_up, w_down); by the implementation the active rules name for the `grouped` seam (8-bit
    QAT), else the plain grouped matmul in the rows' dtype."""
    found = implementation("grouped")
    if found is None:
        import jax
        return jax.lax.ragged_dot(xs_RD, w_EDF.astype(xs_RD.dtype), sizes_E)
    fn, mesh, rules = found
    return fn(xs_RD, w_EDF, sizes_E, site, mesh, rules)


def _project(eq, x, w, site, names, **kw):
    """The matmul of a weight as it arrives: by the implementation the active rules name for
    the `stream` seam where it reads or writes the residual stream (`norm_seq`: the head, the
    row-parallel o and down), with `_gathered` as its local matmul; else `_gathered`."""
    found = implementation("stream") if "norm_seq" in names[0] + names[2] else None
    if found is None:
        return _gathered(eq, x, w, site, names, **kw)
    fn, mesh, rules = found
    return fn(eq, x, w, site, names, mesh, rules,
              lambda x, w: _gathered(eq, x, w, site, names, **kw))


def _gathered(eq, x, w, site, names, **kw):
    found = implementation("gather")
    if found is None:
        return compute(eq, x, w, site, names, **kw)
    fn, mesh, rules = found
    return fn(eq, x, w, site, names, mesh, rules, **kw)


def compute(eq, x, w, site, names, **kw):
    """The matmul of a weight as it arrives (after the `gather` seam): the implementation the
    active rules name for the `projection` seam, else `plain`."""
    found = implementation("projection")
    if found is None:
        return plain(eq, x, w, **kw)
    fn, mesh, rules = found
    return fn(eq, x, w, site, names, mesh, rules, **kw)


def project_columns(eq: str, x, ws: tuple, sites: tuple[str, ...], names: tuple) -> tuple:
    """einsum(eq, x, w) for each w of `ws`, matmuls that read the one input `x` (q, k, v; gate,
    up), each through `project`: as a group by the implementation the active rules name for
    the `columns` seam (tensor parallelism: one region, so that x's gradient is reduced once
    for the group, not once per matmul), else one by one. Under `taps` the group's input is
    tapped once (under its first site) and each output gradient under its own site."""
    if _INSIDE.get():
        return _columns(eq, x, ws, sites, names)
    taps = _taps()
    with _inside():
        ys = _columns(eq, x if taps is None else _expose(x, taps["x"][sites[0]]), ws, sites,
                      names)
    for y, site, n in zip(ys, sites, names):
        _record(site, sites[0], eq, n, x, y)
    return ys if taps is None else tuple(_catch(y, taps["y"][s]) for y, s in zip(ys, sites))


def _columns(eq, x, ws, sites, names):
    found = implementation("columns")
    if found is None:
        return tuple(project(eq, x, w, s, n) for w, s, n in zip(ws, sites, names))
    fn, mesh, rules = found
    return fn(eq, x, ws, sites, names, mesh, rules)


# ----------------------------------------------------------------------------- taps
# A split backward (the pipeline's zero-bubble schedules) computes a stage's input gradient and
# its weight gradients in two passes. The first differentiates the stage with respect to its
# input and to "taps", per-layer inputs (`layer_inputs(..., TAPS)`) of zeros beside each weight
# matmul: its input passes through `_expose` and its output through `_catch`, identities whose
# backward hands the tap the matmul's input and its output gradient. The weight gradients are
# then each matmul's own backward from those two (`weight_grad`), with no second pass through
# the chain. `recording()` lists the tapped matmuls of a trace, to build the taps from.
TAPS = "taps"
_INSIDE: contextvars.ContextVar = contextvars.ContextVar("jaxscale_tap_inside", default=False)
_RECORD: contextvars.ContextVar = contextvars.ContextVar("jaxscale_tap_record", default=None)


@contextlib.contextmanager
def _inside():
    token = _INSIDE.set(True)
    try:
        yield
    finally:
        _INSIDE.reset(token)


def _taps():
    """This layer's taps ({"x": {input key: zeros}, "y": {site: zeros}}), or None."""
    return layer_input(TAPS)


@contextlib.contextmanager
def recording():
    """A dict filled while tracing inside the block: site -> (input key, einsum, names, input
    shape and dtype, output shape and dtype) of every matmul that `project` or `project_columns`
    runs outside the projection's own regions."""
    book: dict = {}
    token = _RECORD.set(book)
    try:
        yield book
    finally:
        _RECORD.reset(token)


def _record(site, key, eq, names, x, y):
    book = _RECORD.get()
    if book is not None:
        book[site] = (key, eq, names, (x.shape, x.dtype), (y.shape, y.dtype))


def _identity_vjp(kind: str):
    import jax

    @jax.custom_vjp
    def tap(v, t):
        return v

    def fwd(v, t):
        return v, (v if kind == "input" else None)

    def bwd(kept, g):
        return g, (kept if kind == "input" else g)
    tap.defvjp(fwd, bwd)
    return tap


def _expose(x, tap):
    return x if tap is None else _TAP_FNS["input"](x, tap)


def _catch(y, tap):
    return y if tap is None else _TAP_FNS["output"](y, tap)


class _Lazy(dict):
    def __missing__(self, kind):
        self[kind] = _identity_vjp(kind)
        return self[kind]


_TAP_FNS = _Lazy()


def weight_grad(eq: str, x, w, dy, site: str, names, scales=None):
    """The gradient of w in einsum(eq, x, w) through the plan's projection, from the matmul's
    input x and output gradient dy: the matmul's own backward, its forward unused. `scales`:
    the layer's per-layer inputs of the projection (fp8 QAT's), read, not differentiated: the
    amaxes this backward would report are those of the same x, w and dy, which the input
    gradient's pass recorded; reporting them again would keep the weight's own amax, and with
    it the weight's gather (ZeRO++'s, FSDP's) alive in this pass."""
    import jax

    def f(w):
        token = _LAYER_INPUT.set(({} if scales is None else {SCALES: scales}, {}))
        try:
            with _inside():
                return _project(eq, x, w, site, names)
        finally:
            _LAYER_INPUT.reset(token)
    y, back = jax.vjp(f, w)
    return back(dy.astype(y.dtype))[0]


# ----------------------------------------------------------------------------- per-layer inputs
# An implementation with per-layer state (fp8 delayed scaling: each layer's scales) hands the
# model's layer loop a tree of [layers, ...] arrays with `layer_inputs`; the loop (`Llama.blocks`)
# scans it beside the stacked weights and each layer's matmuls read their slice with
# `layer_input()`. Gradients with respect to the tree flow back through the scan as usual. Each
# user names its tree (`SCALES`, `TAPS`), so several can ride the loop at once.
SCALES = "scales"
_LAYER_INPUTS: contextvars.ContextVar = contextvars.ContextVar("jaxscale_layer_inputs",
                                                               default=None)
_LAYER_INPUT: contextvars.ContextVar = contextvars.ContextVar("jaxscale_layer_input", default=None)


@contextlib.contextmanager
def layer_inputs(tree, name: str = SCALES):
    """While tracing inside the block, the model's layer loop carries `tree` ([layers, ...]
    leaves), one slice per layer, under `name` (beside any others already set)."""
    token = _LAYER_INPUTS.set({**(_LAYER_INPUTS.get() or {}), name: tree})
    try:
        yield
    finally:
        _LAYER_INPUTS.reset(token)


def scanned_inputs(rows: tuple[int, int] | None = None):
    """The per-layer inputs set by `layer_inputs` ({name: tree}; layers start..start+n-1 with
    `rows`), or None."""
    tree = _LAYER_INPUTS.get()
    if tree is None or rows is None:
        return tree
    import jax
    return jax.tree.map(lambda a: a[rows[0]:rows[0] + rows[1]], tree)


def with_layer_input(body: Callable) -> Callable:
    """body(x, layer_state) -> fn(x, (layer_state, this layer's inputs)) running body with
    `layer_input()` (and a fresh `layer_cache()`) set: the layer loop's step."""
    def run(x, xs):
        state, mine = xs
        token = _LAYER_INPUT.set((mine or {}, {}))
        try:
            return body(x, state)
        finally:
            _LAYER_INPUT.reset(token)
    return run


def layer_input(name: str = SCALES):
    """This layer's slice of the per-layer inputs named `name`, or None."""
    here = _LAYER_INPUT.get()
    return None if here is None else here[0].get(name)


@contextlib.contextmanager
def this_layer(name: str, value):
    """This layer's input `name` replaced by `value` while tracing inside the block (a region
    that brings the layer's inputs in as its own arguments)."""
    here = _LAYER_INPUT.get()
    mine, cache = here if here is not None else ({}, {})
    token = _LAYER_INPUT.set(({**mine, name: value}, cache))
    try:
        yield
    finally:
        _LAYER_INPUT.reset(token)


@contextlib.contextmanager
def own_layer(scales):
    """While tracing inside the block: this layer's `SCALES` input replaced by `scales` and a
    fresh `layer_cache()`, for a matmul traced inside its own function (a custom VJP's forward
    or backward), whose values must not leak into the layer's shared cache."""
    here = _LAYER_INPUT.get()
    token = _LAYER_INPUT.set(({**(here[0] if here else {}), SCALES: scales}, {}))
    try:
        yield
    finally:
        _LAYER_INPUT.reset(token)


def layer_cache() -> dict | None:
    """A dict living while one layer is traced (None outside the layer loop), for values its
    matmuls share: one fp8 cast of the input that q, k and v all read, so that their backward
    keeps one copy."""
    here = _LAYER_INPUT.get()
    return None if here is None else here[1]
