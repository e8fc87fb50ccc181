"""Data parallelism over the `dp` mesh axis, and the gradient reduction every data axis shares.

Rules: `batch -> (dp, fsdp, ep)`, the data axes outer to inner (composed in `plan.rules`);
parameters stay replicated over `dp`. Saves: activations split n ways. Costs: every replica holds
the whole model state (16 bytes/param with mixed-precision Adam; ZeRO shards it, `zero.py`).
Collectives per step: the gradient reduction over the data axes, 2(n-1)/n x gradient bytes on
the wire per device for an all-reduce. As XLA compiles it, once per micro-batch (inside the
accumulation loop): a matmul weight is reduce-scattered over `fsdp` at its fsdp-gathered size,
then all-reduced over the remaining data axes at its shard size (HSDP); a weight whose gradient
is a reduction or a scatter-add (RMSNorm scales, the embedding, a router) is all-reduced over
all data axes at once at its gathered size (XLA reduces, then slices); ZeRO-2/3 nest dp inside
fsdp's dimension, so their matmul gradients are reduced over (dp, fsdp) as one group. Context
parallelism's `sp` shards hold partial gradients too: XLA reduces them over sp on their own, after
the other data axes, at the size those left. Plus one
4-byte all-reduce of the token count (the loss denominator); the other scalar partial sums (loss,
gradient norm) travel in tuples the census counts as 0 bytes. XLA:CPU emits a reduce-scatter as
all-reduce + slice (`cpu_kind`); GPUs emit reduce-scatter.
"""
from __future__ import annotations

import math
from collections import defaultdict

from jaxscale.axes import MESH_AXES
from jaxscale.strategies import pp
from jaxscale.strategies.common import Comm

NAME = "dp"
AVAILABLE = True


def active(spec) -> bool:
    return spec.deg("dp") > 1


def problems(spec) -> list[str]:
    if spec.batch % spec.data_degree:
        names = " x ".join(spec.data_axes)
        return [f"data.batch_size={spec.batch} is not divisible by the data-parallel degree "
                f"{names} = {spec.data_degree}: use a multiple of {spec.data_degree}"]
    return []


def rules(spec, rules) -> None:
    """DP adds no parameter rule: the batch rule over all data axes is composed in plan.py."""


def _group(spec, axes) -> int:
    return math.prod(spec.deg(a) for a in axes)


def _axes(spec, names) -> tuple[str, ...]:
    return tuple(a for a in MESH_AXES if a in set(names))


def collectives(spec) -> list[Comm]:
    """The gradient reduction over every data axis (see the module docstring)."""
    from jaxscale.strategies.tables.params import leaves
    pb, k = spec.wire_param_itemsize, max(1, spec.accumulate)
    data = [a for a in ("dp", "fsdp", "ep") if spec.deg(a) > 1]
    seq = spec.deg("sp") > 1         # sequence shards hold partial gradients too
    if (not data and not seq) or spec.compression != "none" or spec.sparse_embedding \
            or spec.local_sgd != "none":
        return []           # compression/ / sparse_embedding.py / local_sgd/ reduce then
    zero = spec.zero if spec.deg("dp") > 1 else 0
    L = spec.stage_layers
    acc: dict[tuple, list] = defaultdict(lambda: [0.0, 0])
    what: dict[tuple, list] = defaultdict(list)

    def add(kind, axes, nbytes, count, text):
        key = (kind, _axes(spec, axes))
        acc[key][0] += nbytes
        acc[key][1] += count
        if text not in what[key]:
            what[key].append(text)

    for leaf in leaves(spec.model):
        # reduced once per micro-batch (outside the layers: on the pipeline stage using it)
        reps = int(L) * k if leaf.stacked else pp.outer_runs(spec, leaf)
        # every data axis holds partial gradients; experts are complete where they live
        replica = [a for a in data if not (a == "ep" and "experts" in leaf.axes)]
        gathered = leaf.local_size(spec, drop=("fsdp",)) * pb * (k if leaf.stacked else reps)
        if leaf.use in ("norm", "embedding", "router"):
            if replica:
                add("all-reduce", replica, gathered, reps,
                    "gradients of norm scales and the embedding, over all data axes at once")
            if seq:
                add("all-reduce", ["sp"], gathered, reps, "the same over the sequence shards")
            continue
        rest, size = list(replica), gathered
        if zero >= 2 and "dp" in rest:
            group = [a for a in rest if a in ("dp", "fsdp")]
            add("reduce-scatter", group, size, reps, "matmul weight gradients, ZeRO-2/3 "
                "(dp nested in fsdp's dimension: one reduction group)")
            rest = [a for a in rest if a not in group]
            size /= _group(spec, group)
        elif "fsdp" in rest:
            add("reduce-scatter", ["fsdp"], size, reps, "matmul weight gradients")
            rest.remove("fsdp")
            size /= spec.deg("fsdp")
        if rest:
            add("all-reduce", rest, size, reps, "gradients over the replicas")
        if seq:
            add("all-reduce", ["sp"], size, reps, "matmul weight gradients over the sequence "
                "shards (XLA reduces sp on its own, after the other data axes)")
    out = [Comm(kind, axes, nbytes, count, "; ".join(what[(kind, axes)]),
                group=_group(spec, axes), cpu_kind="all-reduce" if kind == "reduce-scatter" else "",
                overlap=True)
           for (kind, axes), (nbytes, count) in acc.items()]
    scalar_axes = _axes(spec, data)      # the batch arrives whole along the sequence (sp.py)
    if scalar_axes:
        out.append(Comm("all-reduce", scalar_axes, 4, 1, "token count (the loss denominator)",
                        group=_group(spec, scalar_axes)))
    return out


def memory(spec) -> list:
    """None of its own: the gradient buffer is the model's (`jaxscale.planner.memory`)."""
    return []


def label(spec) -> list[str]:
    return []
