"""Sequence layouts of context parallelism and the work of each ring hop, in numpy.

A layout is a permutation of a sequence's tokens applied once at the data side; shard r of sp then
holds a contiguous slice of the permuted sequence. `zigzag` cuts the sequence into 2·sp chunks and
gives shard r chunks r and 2sp-1-r (equal causal work per shard); `contiguous` gives shard r
chunk r. `hop_pairs` says which (query rows, key rows) of a shard meet a visiting shard's keys on
a ring hop; `ring_work` counts the tiles each shard visits (`ring.py` runs them).
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from jaxscale.kernels.tiles import tile_map

LAYOUTS = ("zigzag", "contiguous")


def check_layout(T: int, sp: int, layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown sequence layout {layout!r}; valid: {', '.join(LAYOUTS)}")
    n = 2 * sp if layout == "zigzag" else sp
    if T % n:
        hint = (f"pad the sequence to a multiple of {n}, or use layout='contiguous' (T % sp == 0)"
                if layout == "zigzag" else f"pad the sequence to a multiple of {n}")
        raise ValueError(f"{layout} layout cuts the sequence into {n} chunks (sp={sp}): sequence "
                         f"length {T} is not divisible by {n}; {hint}")


def layout_positions(T: int, sp: int, layout: str = "zigzag") -> np.ndarray:
    """[sp, T // sp]: the true positions of the tokens shard r holds, in its local order."""
    check_layout(T, sp, layout)
    if layout == "contiguous":
        return np.arange(T).reshape(sp, T // sp)
    chunks = np.arange(T).reshape(2 * sp, T // (2 * sp))
    return np.stack([np.concatenate([chunks[r], chunks[2 * sp - 1 - r]]) for r in range(sp)])


def layout_permutation(T: int, sp: int, layout: str = "zigzag") -> np.ndarray:
    """[T]: x_layout = x[perm] (layout index i holds the token at true position perm[i])."""
    return layout_positions(T, sp, layout).reshape(-1)


def zigzag_permutation(T: int, sp: int) -> np.ndarray:
    return layout_permutation(T, sp, "zigzag")


def to_layout(x, sp: int, axis: int = 1, layout: str = "zigzag"):
    """Reorder axis `axis` (the sequence) from true order into the layout (numpy stays numpy)."""
    perm = layout_permutation(x.shape[axis], sp, layout)
    return (np if isinstance(x, np.ndarray) else jnp).take(x, perm, axis=axis)


def from_layout(x, sp: int, axis: int = 1, layout: str = "zigzag"):
    """Inverse of `to_layout`."""
    inv = np.argsort(layout_permutation(x.shape[axis], sp, layout))
    return (np if isinstance(x, np.ndarray) else jnp).take(x, inv, axis=axis)


@dataclasses.dataclass(frozen=True)
class Pair:
    """Queries [q0, q1) of this shard against keys [k0, k1) of the visiting shard (local rows)."""
    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool


def hop_pairs(Tl: int, layout: str, causal: bool):
    """(own, before, after): the work of hop 0 (own block) and of a later hop whose kv shard comes
    before (src < r) or after (src > r) this one in the sequence; None = nothing to compute."""
    full = Pair(0, Tl, 0, Tl, False)
    if not causal:
        return full, full, full
    own = Pair(0, Tl, 0, Tl, True)
    if layout == "contiguous":
        return own, full, None
    c = Tl // 2   # zig-zag: chunk r (rows :c) and chunk 2sp-1-r (rows c:)
    return own, Pair(0, Tl, 0, c, False), Pair(c, Tl, 0, Tl, False)


def ring_work(T: int, sp: int, *, layout: str = "zigzag", causal: bool = True,
              block_q: int = 16, block_k: int = 16) -> list[int]:
    """Tiles (block_q x block_k) each shard visits over all hops of ring / all-gather attention."""
    check_layout(T, sp, layout)
    own, before, after = hop_pairs(T // sp, layout, causal)
    out = []
    for r in range(sp):
        n = 0
        for s in range(sp):
            pair = own if s == 0 else before if (r - s) % sp < r else after
            if pair is not None:
                n += tile_map(pair.q1 - pair.q0, pair.k1 - pair.k0, block_q, block_k,
                              causal=pair.causal).visited
        out.append(n)
    return out
