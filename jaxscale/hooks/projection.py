"""The model's weight matmuls, through one hook a plan can replace.

Every matmul of an activation with a weight in `models/llama.py` (q, k, v, o, gate, up, down and
the LM head) calls `project(eq, x, w, site, names)`: `eq` is the einsum, `site` the weight's name
(`SITES`) and `names` the logical axes of x, w and the output. Outside a plan, or when the active
rules name no implementation for the `projection` seam, it is `einsum(eq, x, w.astype(x.dtype))`
(`plain`). A strategy that changes how the matmuls run (tensor-parallel matmuls overlapped with
their collectives, 8-bit quantisation-aware training) registers an implementation
`fn(eq, x, w, site, names, mesh, rules, **kw)` with `jaxscale.hooks.register("projection", name)`
and names it in its `rules`; the model itself never learns which one runs.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Callable

from jaxscale.hooks import implementation

#: the weight matmuls of a block, then the LM head
SITES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "head")


def plain(eq: str, x, w, **kw):
    import jax.numpy as jnp
    return jnp.einsum(eq, x, w.astype(x.dtype), **kw)


def project(eq: str, x, w, site: str, names: tuple[tuple, tuple, tuple], **kw):
    """einsum(eq, x, w) by the active plan's implementation; `kw` (e.g.
    `preferred_element_type`) goes to the einsum."""
    found = implementation("projection")
    if found is None:
        return plain(eq, x, w, **kw)
    fn, mesh, rules = found
    return fn(eq, x, w, site, names, mesh, rules, **kw)


def project_columns(eq: str, x, ws: tuple, sites: tuple[str, ...], names: tuple) -> tuple:
    """einsum(eq, x, w) for each w of `ws`, matmuls that read the one input `x` (q, k, v; gate,
    up), each through `project`: as a group by the implementation the active rules name for
    the `columns` seam (tensor parallelism: one region, so that x's gradient is reduced once
    for the group, not once per matmul), else one by one."""
    found = implementation("columns")
    if found is None:
        return tuple(project(eq, x, w, s, n) for w, s, n in zip(ws, sites, names))
    fn, mesh, rules = found
    return fn(eq, x, ws, sites, names, mesh, rules)


# ----------------------------------------------------------------------------- per-layer inputs
# An implementation with per-layer state (fp8 delayed scaling: each layer's scales) hands the
# model's layer loop a tree of [layers, ...] arrays with `layer_inputs`; the loop (`Llama.blocks`)
# scans it beside the stacked weights and each layer's matmuls read their slice with
# `layer_input()`. Gradients with respect to the tree flow back through the scan as usual.
_LAYER_INPUTS: contextvars.ContextVar = contextvars.ContextVar("jaxscale_layer_inputs",
                                                               default=None)
_LAYER_INPUT: contextvars.ContextVar = contextvars.ContextVar("jaxscale_layer_input", default=None)


@contextlib.contextmanager
def layer_inputs(tree):
    """While tracing inside the block, the model's layer loop carries `tree` ([layers, ...]
    leaves), one slice per layer."""
    token = _LAYER_INPUTS.set(tree)
    try:
        yield
    finally:
        _LAYER_INPUTS.reset(token)


def scanned_inputs(rows: tuple[int, int] | None = None):
    """The per-layer inputs set by `layer_inputs` (layers start..start+n-1 with `rows`), or None."""
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
        token = _LAYER_INPUT.set((mine, {}))
        try:
            return body(x, state)
        finally:
            _LAYER_INPUT.reset(token)
    return run


def layer_input():
    """This layer's slice of the per-layer inputs, or None."""
    here = _LAYER_INPUT.get()
    return None if here is None else here[0]


def layer_cache() -> dict | None:
    """A dict living while one layer is traced (None outside the layer loop), for values its
    matmuls share: one fp8 cast of the input that q, k and v all read, so that their backward
    keeps one copy."""
    here = _LAYER_INPUT.get()
    return None if here is None else here[1]
