"""The pure-Python side of the compressed gradient means (`methods.py`, `powersgd.py`): the method
names, the checks of their arguments and the formulas a census is compared to (no JAX: the
protocol in `__init__.py` reads them while the plan is composed).

`collectives` gives the collectives one compressed mean puts in the compiled program, per device,
in the census's convention (`bytes`: all-reduce buffer, all-gather output, all-to-all buffer);
`inspect.census` of a compiled step equals it row by row (PowerSGD's rows are
`powersgd_collectives`). `wire_bytes` is what each device puts on its link per step with ring
collectives (the "link bytes/device" column of the table in `methods`), `payload_bytes` the
compressed gradient one device contributes. In the block-scaled bucket each leaf starts a new
block (its values never share a scale with another leaf's) and the whole is padded to a multiple
of N*B (`bucket_size`); the padding is counted: it is on the wire.
"""
from __future__ import annotations

import math

import numpy as np

from jaxscale.strategies.common import Comm

#: the gradient means, the uncompressed fp32 all-reduce first
METHODS = ("fp32", "bf16", "fp8", "int8", "sign", "topk", "threshold", "powersgd")
#: the methods with error feedback: a per-device residual (and PowerSGD's Q) kept across steps
STATEFUL = ("sign", "topk", "threshold", "powersgd")


# ---------------------------------------------------------------------------------------------
# the checks of the arguments
# ---------------------------------------------------------------------------------------------
def check_axes(axes) -> tuple[str, ...]:
    """The data axes as a tuple; a clear error when none is given."""
    if isinstance(axes, str):
        axes = (axes,)
    axes = tuple(axes or ())
    if not axes:
        raise ValueError("gradient compression needs the data axes to reduce over, e.g. "
                         "axes=('dp',) or ('dp', 'fsdp'); got none. A plan without data-parallel "
                         "axes has no gradient all-reduce to compress: drop compression from it.")
    if not all(isinstance(a, str) for a in axes):
        raise ValueError(f"axes must be mesh axis names (str), got {axes!r}")
    return axes


def padded_size(size: int, n: int, block: int, pad: bool = True, what: str = "block") -> int:
    """`size` rounded up to a multiple of n * block (each device's shard is whole blocks)."""
    m = n * block
    if size % m and not pad:
        raise ValueError(f"{what}={block} x {n} devices = {m} does not divide the gradient's "
                         f"{size} elements; pick a block so that N*block divides it, or pass "
                         f"pad=True (zero-pads {(-size) % m} elements, sent on the wire)")
    return size + (-size) % m


def bucket_size(shapes, n: int, block: int, pad: bool = True) -> int:
    """Elements of the block-scaled bucket of these leaf `shapes` over `n` devices: each leaf
    zero-padded to whole blocks (a block's scale is its own leaf's largest value, never a larger
    leaf's: a norm scale's gradient would otherwise round to a bigger neighbour's levels), the
    whole to a multiple of n * block (each device's shard is whole blocks). At most one block of
    padding per leaf, and N-1 blocks at the end."""
    sizes = [math.prod(s) for s in _shapes(shapes)]
    aligned = sum(-(-s // block) * block for s in sizes)
    if not pad and aligned != sum(sizes):
        odd = next(s for s in sizes if s % block)
        raise ValueError(f"block={block} does not divide a gradient leaf of {odd} elements (each "
                         f"leaf is whole blocks); pick a block that divides every leaf, or pass "
                         f"pad=True (zero-pads {aligned - sum(sizes)} elements, sent on the "
                         f"wire)")
    return padded_size(aligned, n, block, pad)


def _check_block(method: str, block: int) -> None:
    if not isinstance(block, (int, np.integer)) or block < 1:
        raise ValueError(f"block must be a positive int (elements per scale), got {block!r}")
    if method == "sign" and block % 8:
        raise ValueError(f"sign compression packs 8 signs per byte: block must be a multiple "
                         f"of 8, got block={block}; use e.g. block={8 * max(1, block // 8)}")


def _check_k(k, size: int, name: str = "k") -> int:
    if not isinstance(k, (int, np.integer)) or not 1 <= k <= size:
        raise ValueError(f"{name} must be an int in [1, {size}] (the gradient has {size} "
                         f"elements), got {name}={k!r}; e.g. k = max(1, int(0.01 * {size}))")
    return int(k)


def _check_method(method: str) -> None:
    if method not in METHODS:
        raise ValueError(f"unknown compression method {method!r}; valid: {', '.join(METHODS)}")


# ---------------------------------------------------------------------------------------------
# bytes: the formulas a census is compared to
# ---------------------------------------------------------------------------------------------
def _shapes(shape) -> list[tuple[int, ...]]:
    if len(shape) and all(isinstance(s, (int, np.integer)) for s in shape):
        return [tuple(int(s) for s in shape)]
    return [tuple(int(d) for d in s) for s in shape]


def collectives(method: str, shape, n_devices: int, axes=("dp",), **params) -> list[Comm]:
    """The collectives one compressed mean puts in the compiled program, per device, in the
    census's convention (`bytes`: all-reduce buffer, all-gather output, all-to-all buffer).
    `shape`: one gradient shape, or a list of them (a pytree's leaves)."""
    _check_method(method)
    shapes, n, axes = _shapes(shape), int(n_devices), check_axes(axes)
    if n < 1:
        raise ValueError(f"n_devices must be >= 1, got {n_devices}")
    size = sum(math.prod(s) for s in shapes)
    c = lambda kind, nbytes, what: Comm(kind, axes, float(nbytes), 1, what, n)
    if method == "powersgd":
        return [c(kind, b, what) for kind, b, what in powersgd_collectives(shapes, params["rank"])]
    if method == "fp32":
        return [c("all-reduce", 4 * size, "fp32 gradient")]
    if method in ("topk", "threshold"):
        k = _check_k(params["k"], size)
        v = np.dtype(params.get("value_dtype", np.float32)).itemsize
        return [c("all-gather", n * k * v, "top-k values"), c("all-gather", n * k * 4, "indices")]
    block = 1 if method == "bf16" else params.get("block", 256)
    _check_block(method, block)
    lp = bucket_size(shapes, n, block, params.get("pad", True))
    per_elem = {"bf16": 2, "fp8": 1, "int8": 1, "sign": 1 / 8}[method]
    rows = [c("all-to-all", lp * per_elem, f"{method} shards"),
            c("all-gather", lp * per_elem, f"{method} mean")]
    if method != "bf16":
        rows += [c("all-to-all", 4 * lp // block, "scales"), c("all-gather", 4 * lp // block,
                                                                  "scales")]
    return rows


def wire_bytes(method: str, shape, n_devices: int, **params) -> int:
    """Bytes each device puts on its link per step with bandwidth-optimal (ring) collectives:
    the census's `wire_bytes` summed. fp32: 2(N-1)/N 4L; int8: 2(N-1)/N (L + 4L/B), L the
    bucket's elements (`bucket_size`: each leaf whole blocks, the whole N*B);
    top-k: (N-1) k (4 + v); PowerSGD: 2(N-1)/N (n + m) r 4."""
    return int(round(sum(c.wire_bytes for c in collectives(method, shape, n_devices, **params))))


def payload_bytes(method: str, shape, n_devices: int, **params) -> int:
    """The compressed gradient one device contributes per step: fp32 4L; int8/fp8 L + 4L/B;
    bf16 2L; sign L/8 + 4L/B (padded L); top-k k (4 + v); PowerSGD (n + m) r 4 per matrix
    (+ 4 x size of the vectors)."""
    rows = collectives(method, shape, n_devices, **params)
    if method == "fp32" or method == "powersgd":
        return int(sum(c.bytes for c in rows))
    if method in ("topk", "threshold"):
        return int(sum(c.bytes for c in rows) // n_devices)
    return int(sum(c.bytes for c in rows if c.kind == "all-gather"))


# ---------------------------------------------------------------------------------------------
# PowerSGD
# ---------------------------------------------------------------------------------------------
def is_matrix(shape, rank: int) -> bool:
    """Whether a leaf of this shape is compressed at this rank (its last two dims both > rank)."""
    return len(shape) >= 2 and min(shape[-2:]) > rank


def _check_rank(shapes, rank: int, where: str) -> None:
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"PowerSGD rank must be an int >= 1, got rank={rank!r}")
    mats = [tuple(s) for s in shapes if len(s) >= 2]
    if mats and not any(is_matrix(s, rank) for s in mats):
        top = max(min(s[-2:]) for s in mats)
        raise ValueError(f"PowerSGD rank={rank} exceeds the matrix dimension of every {where} "
                         f"(shapes {mats[:3]}{' ...' if len(mats) > 3 else ''}: at most rank "
                         f"{top - 1} compresses one); lower the rank to <= {top - 1}")


def powersgd_collectives(shapes, rank: int) -> list[tuple[str, int, str]]:
    """(kind, bytes, what) of one step: all-reduce #1 = P's of all matrices + the vectors,
    all-reduce #2 = Q's, fp32."""
    p_bytes = q_bytes = vec_bytes = 0
    _check_rank(shapes, rank, "gradient")
    for s in shapes:
        if is_matrix(s, rank):
            b = math.prod(s[:-2])
            p_bytes += 4 * b * s[-2] * rank
            q_bytes += 4 * b * s[-1] * rank
        else:
            vec_bytes += 4 * math.prod(s)
    rows = [("all-reduce", p_bytes + vec_bytes, "P [n, r] (+ uncompressed vectors)")]
    return rows + ([("all-reduce", q_bytes, "Q [m, r]")] if q_bytes else [])
