"""Data parallelism over the `dp` mesh axis, and the gradient reduction every data axis shares.

Rules: `batch -> (dp, fsdp, ep)`, the data axes outer to inner (composed in `plan.rules`);
parameters stay replicated over `dp`. Saves: activations split n ways. Costs: every replica holds
the whole model state (16 bytes/param with mixed-precision Adam; ZeRO shards it, `zero.py`).

Collectives per step: the gradient reduction over the data axes, 2(n-1)/n x gradient bytes on the
wire per device for an all-reduce, and one 4-byte all-reduce of the token count (the loss
denominator). When the gradients are reduced is `plan.grad_sync` (`sync_axes`):

- `auto` (the default): once per step over the axes the parameters are replicated on (`dp`,
  unless ZeRO-3 splits them there), once per micro-batch over the axes they are split on (fsdp's
  reduce-scatter, into a sharded accumulator). HSDP thus reduce-scatters inside the node every
  micro-batch and all-reduces across nodes once, as PyTorch DDP's `no_sync`, FSDP2's
  `set_requires_gradient_sync` and Megatron's distributed optimizer do;
- `step`: once per step over every data axis: fsdp's (and ZeRO-3's dp) parameters all-gathered
  once at the start and held for the step, the accumulator whole over those axes (least
  communication, most memory: the planner's `grad_sync` terms);
- `microbatch`: every micro-batch over every axis (least memory: the accumulator is the reduced
  gradient's shard).

With one micro-batch they are the same program. A once-per-step reduction runs the step's
gradients in the data region (`region.py`, `jax.shard_map` manual over those axes, the others
GSPMD's) and reduces there once: a psum over `dp` of each device's shard, a psum_scatter over
the axes a parameter is split on. Gradient compression and the sparse embedding exchange reduce
`dp` there with their own mean: once per step, or with `microbatch` once per micro-batch (the
region loops over the micro-batches, their means weighted by their tokens: k times the method's
bytes, for its error per micro-batch; `mean_runs`).

A per-micro-batch reduction is XLA's: a matmul weight is reduce-scattered over `fsdp` at its
fsdp-gathered size, then all-reduced over the remaining data axes at its shard size (HSDP); a
weight whose gradient is a reduction or a scatter-add (RMSNorm scales, the embedding, a router) is
all-reduced over all data axes at once at its gathered size (XLA reduces, then slices); ZeRO-2/3
nest dp inside fsdp's dimension, so their matmul gradients are reduced over (dp, fsdp) as one
group. Context parallelism's `sp` shards hold partial gradients too: XLA reduces them over sp on
their own, per micro-batch, at the size the other data axes left. The other scalar partial sums
(loss, gradient norm) travel in tuples the census counts as 0 bytes. XLA:CPU emits a
reduce-scatter as all-reduce + slice (`cpu_kind`); GPUs emit reduce-scatter.
"""
from __future__ import annotations

import math
from collections import defaultdict

from jaxscale.axes import DATA_AXES, MESH_AXES, entry_axes
from jaxscale.strategies.accumulate import region_loops
from jaxscale.strategies.common import Comm, Term, own_mean, split_axes, sync_axes
from jaxscale.strategies.tables.activations import grouped
from jaxscale.strategies.tables.params import outer_runs

NAME = "dp"
AVAILABLE = True
#: `plan.grad_sync`'s modes
SYNC_MODES = ("auto", "step", "microbatch")


def active(spec) -> bool:
    return spec.deg("dp") > 1


def mean_runs(spec) -> int:
    """How many times per step a strategy's own mean over dp runs: once, or with
    `plan.grad_sync=microbatch` once per micro-batch (`accumulate.region_loops`)."""
    return max(1, spec.accumulate) if region_loops(spec) else 1


def problems(spec) -> list[str]:
    errs = []
    if spec.batch % spec.data_degree:
        names = " x ".join(spec.data_axes)
        errs.append(f"data.batch_size={spec.batch} is not divisible by the data-parallel degree "
                    f"{names} = {spec.data_degree}: use a multiple of {spec.data_degree}")
    if spec.grad_sync not in SYNC_MODES:
        errs.append(f"plan.grad_sync={spec.grad_sync!r}: valid are {', '.join(SYNC_MODES)}")
    return errs


def rules(spec, rules) -> None:
    """DP adds no parameter rule: the batch rule over all data axes is composed in plan.py."""


def _group(spec, axes) -> int:
    return math.prod(spec.deg(a) for a in axes)


def _axes(spec, names) -> tuple[str, ...]:
    return tuple(a for a in MESH_AXES if a in set(names))


def _entry(entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def collectives(spec) -> list[Comm]:
    """The gradient reduction over every data axis (see the module docstring)."""
    from jaxscale.strategies.tables.params import leaves
    pb, k = spec.wire_param_itemsize, max(1, spec.accumulate)
    # local SGD averages the replicas over dp itself (local_sgd/); inside each replica (an
    # fsdp x tp group) the other data axes reduce as in any step
    data = [a for a in DATA_AXES if spec.deg(a) > 1
            and not (a == "dp" and spec.local_sgd != "none")]
    seq = spec.deg("sp") > 1         # sequence shards hold partial gradients too
    if not data and not seq:
        return []
    once = set(sync_axes(spec))
    if own_mean(spec):
        once.discard("dp")   # compression/ and sparse_embedding.py reduce dp then
    zero = spec.zero if spec.deg("dp") > 1 else 0
    L = spec.layers_per_device
    from jaxscale.strategies import prune
    from jaxscale.strategies import zero as zero_lib
    from jaxscale.strategies.zero import gather_axes, stored_spec
    from jaxscale.strategies.zeropp import reduced, region_axes
    quantised = reduced(spec)
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
        reps = L * k if leaf.stacked else outer_runs(spec, leaf)
        # every data axis holds partial gradients; experts are complete where they live
        replica = [a for a in data if not (a == "ep" and "experts" in leaf.axes)]
        inner = [a for a in replica if a not in once and not (a == "dp" and own_mean(spec))]
        gathered = leaf.run_size(spec, drop=("fsdp",)) * pb * (k if leaf.stacked else reps)
        shard = leaf.run_size(spec) * pb
        if once:                     # the data region: the accumulated fp32 gradient, once
            stored = stored_spec(spec, leaf)
            size = leaf.local_size(spec, drop=tuple(once)) * 4     # rules never split dp
            left = [a for a in MESH_AXES if a in once]
            for entry in stored:
                over = [a for a in _entry(entry) if a in once]
                if over:
                    add("psum-scatter", over, size, 1, "gradients split over the axis: "
                        "scattered back to their shards once per step (the data region)")
                    size /= _group(spec, over)
                    left = [a for a in left if a not in over]
            if left:
                add("all-reduce", left, size, 1, "gradients over the replicas, once per step "
                    "(the data region)")
        if leaf.use in ("norm", "embedding", "router"):
            if inner:
                add("all-reduce", inner, gathered, reps,
                    "gradients of norm scales and the embedding, over all data axes at once")
            if seq and not (leaf.use in ("norm", "router") and spec.sequence_parallel
                            and spec.deg("tp") > 1):     # tp.py: reduced over (sp, tp) at once
                add("all-reduce", ["sp"], gathered, reps, "the same over the sequence shards")
            continue
        rest, size = list(inner), gathered
        if leaf.path in quantised:      # qgZ scatters over its gather axes (zeropp/), then
            rest = [a for a in rest if a not in gather_axes(spec)] + ["sp"] * seq  # sums
            if rest:
                add("all-reduce", rest, size / _group(spec, region_axes(spec)), reps, "matmul "
                    "weight gradients over the other replicas, after qgZ's reduce-scatter")
            continue
        if "experts" in leaf.axes and grouped(spec):
            # the grouped experts' region (`strategies/ep/grouped.py`) gathers the expert
            # weights over fsdp inside: its transpose scatters them back there, then the region
            # sums them over the other data axes and the sequence shards, at the shard's size
            if "fsdp" in rest:
                add("psum-scatter", ["fsdp"], size, reps, "expert weight gradients, scattered "
                    "over fsdp in the grouped experts' region")
                rest.remove("fsdp")
                size /= spec.deg("fsdp")
            if rest or seq:
                add("all-reduce", rest + ["sp"] * seq, size, reps, "expert weight gradients "
                    "over the replicas and the sequence shards (the grouped experts' region)")
            continue
        cm = spec.tp_overlap != "none" and leaf.stacked      # in the collective matmul's region
        if zero >= 2 and "dp" in rest:
            # a layer's matmul weights (in the scan) with ep among the replicas, split over dp
            # on the layer axis: each layer's gradient is whole in the scan and XLA reduces over
            # ep in the same group; split within a layer (dp4 x ep2, ZeRO-3 on the embed axis),
            # or the head outside the scan, the dp shard is reduced over ep after
            whole = leaf.stacked and "dp" in entry_axes(zero_lib.shard_entries(
                stored_spec(spec, leaf), leaf.shape, spec.degrees, zero,
                keep=prune.leaf_keep(spec, leaf))[0])
            group = [a for a in rest if a in ("dp", "fsdp") or (a == "ep" and whole)]
            add("reduce-scatter", group, size, reps, "matmul weight gradients, ZeRO-2/3 "
                "(dp nested in fsdp's dimension: one reduction group)")
            rest = [a for a in rest if a not in group]
            size /= _group(spec, group)
        elif "fsdp" in rest:
            # a block weight of the collective matmul is gathered over fsdp in its region: the
            # gather's transpose is a reduce-scatter there, which XLA:CPU emits as one
            add("psum-scatter" if cm else "reduce-scatter", ["fsdp"], size, reps,
                "matmul weight gradients" + (" (the collective matmul's region)" if cm else ""))
            rest.remove("fsdp")
            size /= spec.deg("fsdp")
        if (rest and seq and "fsdp" in inner) or ((rest or seq) and cm):
            # after fsdp's reduce-scatter XLA reduces the other data axes and the sequence
            # shards in one all-reduce; so does the collective matmul's region (whole mesh)
            add("all-reduce", rest + ["sp"] * seq, size, reps, "matmul weight gradients over the"
                " replicas and the sequence shards at once")
            continue
        if rest:
            add("all-reduce", rest, size, reps, "gradients over the replicas")
        if seq:
            add("all-reduce", ["sp"], size if rest or "fsdp" in replica else
                shard * (k if leaf.stacked else reps),
                reps, "matmul weight gradients over the sequence shards (XLA reduces sp on "
                "its own, after the other data axes)")
    # XLA:CPU emits GSPMD's reduce-scatters as all-reduce + slice, but the data region's own
    # psum_scatter ("psum-scatter" above) as a reduce-scatter
    out = [Comm("reduce-scatter" if kind == "psum-scatter" else kind, axes, nbytes, round(count),
                "; ".join(what[(kind, axes)]), group=_group(spec, axes),
                cpu_kind="all-reduce" if kind == "reduce-scatter" else "", overlap=True)
           for (kind, axes), (nbytes, count) in acc.items()]
    # the batch arrives whole along the sequence (sp.py); the data region sums the count with
    # the loss, one [2] fp32 array
    region = sync_axes(spec)
    scalar_axes = _axes(spec, region or data)
    if scalar_axes:
        runs = mean_runs(spec)       # the region run once per micro-batch: its sums too
        out.append(Comm("all-reduce", scalar_axes, (8 if region else 4) * runs, runs,
                        "loss and token count" if region else "token count (the loss "
                        "denominator)", group=_group(spec, scalar_axes)))
    return out


def memory(spec) -> list[Term]:
    """The once-per-step mode over split axes (`plan.grad_sync=step`, or a data region's own
    mean under ZeRO-3): the parameters gathered over them for the whole step, their gradients
    whole over them until the mean (ZeRO-3 dp8 with the sparse embedding or int8 compression:
    the planner 0.63 of the compiled temp without them, 0.92 with), and with micro-batches the
    fp32 accumulator whole over them (beyond the sharded one `accumulate` counts), one copy: the
    micro-batch loop's carry, updated in place; two under a pipeline, whose engine accumulates
    the gradients in its tick loop and returns them out of its switch (a copy, `pp.engine`:
    pp2 x fsdp2 x tp2 at 0.89 of the compiled temp with one). The gathered parameters are a
    collective's result, at its width (f32 on XLA:CPU). fsdp8 with 4 micro-batches:
    grad_sync=step grows the compiled temp by 4.04 MB in fp32 and 3.14 in bf16, where these
    terms say 4.01 and 3.18 (with the accumulator counted twice and the gathered bf16
    parameters at 2 bytes, 5.68 and 4.01)."""
    split = [a for a in split_axes(spec) if a in sync_axes(spec)]
    if not split:
        return []
    from jaxscale.strategies import zero as zero_lib
    from jaxscale.strategies.tables.params import leaves
    whole = sum(leaf.local_size(spec, drop=tuple(split)) for leaf in leaves(spec.model))
    held = zero_lib.shards(spec).params
    over, more = "x".join(split), whole - held
    piped = spec.deg("pp") > 1
    gathered = Term("backward", more * spec.wire_param_itemsize,
                    f"parameters gathered over {over} for the step (the data region's entry)")
    if spec.accumulate <= 1:        # the gradients of the gathered parameters, before the mean
        return [gathered, Term("backward", more * spec.param_itemsize,
                               f"the step's gradients whole over {over} before their mean")]
    return [gathered,
            Term("backward", more * 4 * (1 + piped),
                 f"fp32 gradient accumulator whole over {over}, the loop's carry"
                 f"{' in and out of the pipeline switch' if piped else ''} (grad_sync=step)"),
            Term("backward", more * spec.param_itemsize,
                 f"a micro-batch's gradients whole over {over} before they are added "
                 f"(grad_sync=step)"),
            Term("update", more * 4,
                 f"fp32 gradient accumulator whole over {over} (grad_sync=step)")]


def label(spec) -> list[str]:
    return [f"sync-{spec.grad_sync}"] if spec.grad_sync != "auto" else []


def shape_step(spec, parts) -> None:
    """The step: with a once-per-step reduction (`sync_axes`), the gradients computed in the data
    region and reduced there (`region.make`), by the strategy's mean when one set `parts.mean`."""
    axes = sync_axes(spec)
    if not axes:
        return

    def reduce(grads_fn, ctx):
        from jaxscale.strategies.dp import region
        mean = parts.mean
        return region.make(grads_fn, ctx, axes, mean=None if mean is None else mean(ctx),
                           mean_axes=("dp",) if mean is not None else (),
                           micro_batches=mean_runs(spec))
    parts.set("reduce", reduce, by=NAME)
