"""The model's weight matmuls, through one hook a plan can replace.

Every matmul of an activation with a weight in `models/llama.py` (q, k, v, o, gate, up, down and
the LM head) calls `project(eq, x, w, site, names)`: `eq` is the einsum, `site` the weight's name
(`SITES`) and `names` the logical axes of x, w and the output. Outside a plan, or when the active
rules name no implementation (`Rules.projection`), it is `einsum(eq, x, w.astype(x.dtype))`. A
strategy that changes how the matmuls run (tensor-parallel matmuls overlapped with their
collectives, 8-bit quantisation-aware training) registers an implementation here under a name and
sets `Rules.projection` to it in its `rules`; the model itself never learns which one runs.
"""
from __future__ import annotations

from typing import Callable

from jaxscale.axes import active

#: the weight matmuls of a block, then the LM head
SITES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "head")

#: name -> fn(eq, x, w, site, names, mesh, rules) -> einsum(eq, x, w) computed its way
IMPLEMENTATIONS: dict[str, Callable] = {}


def register(name: str):
    def deco(fn):
        IMPLEMENTATIONS[name] = fn
        return fn
    return deco


def plain(eq: str, x, w, **kw):
    import jax.numpy as jnp
    return jnp.einsum(eq, x, w.astype(x.dtype), **kw)


def project(eq: str, x, w, site: str, names: tuple[tuple, tuple, tuple], **kw):
    """einsum(eq, x, w) by the active plan's implementation; `kw` (e.g.
    `preferred_element_type`) goes to the einsum."""
    ctx = active()
    impl = ctx[1].projection if ctx is not None else None
    if impl is None:
        return plain(eq, x, w, **kw)
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"unknown projection implementation {impl!r}; registered: "
                         f"{', '.join(sorted(IMPLEMENTATIONS)) or 'none'}")
    return IMPLEMENTATIONS[impl](eq, x, w, site, names, ctx[0], ctx[1], **kw)
