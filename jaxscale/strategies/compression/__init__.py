"""Gradient compression over `dp`: the gradient mean computed by a compression method (`methods.py`,
`powersgd.py`) instead of an fp32 all-reduce, on any layout of the other axes.

`plan.compression=bf16|fp8|int8|sign|topk|threshold|powersgd` (with `plan.compression_block`,
`_density`, `_threshold`, `_rank`). The step's gradients are computed in the data region
(`strategies.dp.region`), manual over dp (and fsdp with `plan.grad_sync=step`), every other axis
GSPMD's: each dp replica accumulates the gradients of its rows over its micro-batches, any
reduction inside the replica (fsdp's reduce-scatter, tp's and sp's sums) done exactly by XLA, and
weighs them by its share of the real tokens. The method then averages over dp, once per step,
each device its own shards of every leaf (the fsdp and tp pieces it holds), flattened into one
bucket (the block-scaled methods pad each leaf's shard to whole blocks: every scale is one
leaf's, so a norm scale's gradient keeps its own precision): quantised all-to-all + all-gather,
top-k values + indices all-gathered, PowerSGD's two small all-reduces per matrix shard, ...
(`methods.py`). So an HSDP plan (dp across nodes, fsdp
and tp inside) compresses exactly its cross-node reduction. The result is the whole mean on
every dp rank; ZeRO-1/2/3 slice their shards of it (the method's all-gather stage is paid, not
replaced by ZeRO's own gather). With local SGD (`plan.local_sgd`: DiLoCo, SlowMo, ...) there is no
gradient mean over dp: the method averages the replicas' parameter changes instead, once every H
steps, in local SGD's step (`local_sgd.replicas.outer_mean`), its state beside the replicas'
(streamed by fragments, as Streaming DiLoCo's compressed outer gradients, one state per fragment
group, of its parts; `mean_collectives` gives local SGD each average's collectives).

Collectives: those of the method over dp on a device's shards, in place of the gradient
all-reduce over dp, plus one all-reduce of two scalars (tokens and loss). Saves: bytes on the wire
(int8 about 1/4 of fp32's, top-k k (index + value) per device, PowerSGD (n + m) r per matrix).
The block-scaled methods (fp8, int8, sign) send at most one block of padding more per leaf
(a LLaMA model's 12 leaves: 12 blocks; the tiny model on dp2 x fsdp4: 119,808 elements in
place of 119,296). Costs: the error of the method, and for the error-feedback methods (sign,
topk, threshold, powersgd) a per-device fp32 residual the size of the device's gradient shards,
carried in the train state and checkpointed (`TrainState.comm`, one slice per device: a
checkpoint restores it onto the same mesh; onto another, restart it).
"""
from __future__ import annotations

import dataclasses
import math

from jaxscale.strategies import dp
from jaxscale.strategies.common import Comm, Term
from jaxscale.strategies.compression import formulas
from jaxscale.strategies.compression.formulas import STATEFUL, is_matrix
from jaxscale.strategies.tables.params import leaves

NAME = "compression"
AVAILABLE = True
#: `plan.compression`'s methods (`formulas.METHODS` but the uncompressed fp32 all-reduce)
METHODS = tuple(m for m in formulas.METHODS if m != "fp32")


def active(spec) -> bool:
    return spec.compression != "none"


def _sizes(spec) -> list[tuple[int, ...]]:
    """The shapes of a device's gradient shards, as the method sees them (the rules' split of
    each leaf over fsdp, tp, ep and pp; dp never splits a gradient before the mean), but the
    embedding's when `plan.sparse_embedding` exchanges it."""
    return [leaf.local_shape(spec) for leaf in leaves(spec.model)
            if not (spec.sparse_embedding and leaf.use == "embedding")]


def params(spec, shapes=None) -> dict:
    """The keyword arguments of `jaxscale.strategies.compression.methods.compressed_mean` for this
    plan, on a device's gradient shards (`shapes`: the shards one mean takes, if not all)."""
    m = spec.compression
    if m in ("fp8", "int8", "sign"):
        return {"block": spec.compression_block}
    if m in ("topk", "threshold"):
        shapes = _sizes(spec) if shapes is None else shapes
        k = max(1, int(spec.compression_density * sum(math.prod(s) for s in shapes)))
        return {"k": k, **({"threshold": spec.compression_threshold} if m == "threshold" else {})}
    if m == "powersgd":
        return {"rank": spec.compression_rank}
    return {}


def problems(spec) -> list[str]:
    if not active(spec):
        return []
    if spec.compression not in METHODS:
        return [f"plan.compression={spec.compression!r}: valid are none, {', '.join(METHODS)}"]
    errs = []
    if spec.deg("dp") == 1:
        errs.append(f"plan.compression={spec.compression} compresses the gradient mean over "
                    f"mesh.dp, but mesh.dp=1: give the devices to dp, or set "
                    f"plan.compression=none")
    if spec.compression == "powersgd":
        top = max((min(s[-2:]) for s in _sizes(spec) if len(s) >= 2), default=0)
        if spec.compression_rank >= top:
            errs.append(f"plan.compression_rank={spec.compression_rank} leaves no gradient "
                        f"matrix to compress (the largest has smaller dimension {top}): use a "
                        f"rank < {top}")
    return errs


def rules(spec, rules) -> None:
    """Compression adds no sharding rule."""


def collectives(spec) -> list[Comm]:
    """The method's collectives in place of the gradient mean (local SGD's outer averages are
    `local_sgd.collectives`', through `mean_collectives`)."""
    if not active(spec) or spec.local_sgd != "none":
        return []
    rows = formulas.collectives(spec.compression, _sizes(spec), spec.deg("dp"), ("dp",),
                                **params(spec))
    runs = dp.mean_runs(spec)
    if runs > 1:                    # plan.grad_sync=microbatch: once per micro-batch
        rows = [dataclasses.replace(r, bytes=r.bytes * runs, count=r.count * runs,
                                    what=f"{r.what}, once per micro-batch ({runs})")
                for r in rows]
    return rows


def mean_collectives(spec, shapes) -> list[Comm]:
    """The collectives of one compressed mean over dp of a device's shards of these `shapes`
    (local SGD's outer average of the parameter changes, or one fragment group's of them)."""
    return formulas.collectives(spec.compression, shapes, spec.deg("dp"), ("dp",),
                                **params(spec, shapes))


def memory(spec) -> list[Term]:
    """The error-feedback residual: one fp32 copy of the gradients per device (sign: plus the
    residual of its shard of the mean; PowerSGD: plus its Q matrices). The 8-bit block-scaled
    means (int8, fp8) hold two fp32 buckets of a device's gradients beside the gradients they
    read, after the backward and before the update (its own phase: with the optimizer offloaded
    they are freed before its streamed pieces): the gradients flattened to be quantised, and the
    dequantized mean (dp8: the compiled temp 3.00-3.01 gradient buffers on 2 and 4 layers,
    vocabularies 320 and 2048, where the backward peaks lower; the planner at 0.63-0.77 of it
    without them). XLA:CPU reads float16 gradients into them widened to f32, and the phase
    peaks at three fp32 gradient buffers whatever the gradients' dtype (dp8 int8: 9.19 MB in
    fp16 and in fp32; the planner was at 0.83 of the fp16 temp counting the gradients at 2
    bytes)."""
    if not active(spec):
        return []
    size = sum(math.prod(s) for s in _sizes(spec))
    if spec.compression in ("int8", "fp8") and spec.local_sgd == "none":
        out = [Term("mean", 2 * 4 * size, f"the {spec.compression} mean's fp32 buckets: the "
                    "gradients flattened and the dequantized mean")]
        if not spec.hardware.native_16bit and spec.held_param_itemsize < 4:
            out.append(Term("mean", (4 - spec.held_param_itemsize) * size,
                            "the 16-bit gradients the mean reads, widened to f32 (XLA:CPU)"))
        return out
    if spec.compression not in STATEFUL:
        return []
    extra = size / spec.deg("dp") if spec.compression == "sign" else 0
    if spec.compression == "powersgd":
        extra = sum(math.prod(s[:-2]) * s[-1] * spec.compression_rank for s in _sizes(spec)
                    if is_matrix(s, spec.compression_rank))
    return [Term("optimizer", 4 * (size + extra), f"{spec.compression} error-feedback state")]


def label(spec) -> list[str]:
    return [f"comp-{spec.compression}"] if active(spec) else []


# ----------------------------------------------------------------------------- the step side
def shape_step(spec, parts) -> None:
    """The step: the gradient mean over dp computed by the method (`mean`) in the data region
    (`strategies.dp` sets the region), its error-feedback state per device in `TrainState.comm`."""
    if not active(spec) or spec.local_sgd != "none":     # local SGD's outer mean runs it
        return
    if not spec.sparse_embedding:       # else its mean calls this one for the other gradients
        parts.set("mean", lambda ctx: mean(spec), by=NAME)
    if spec.compression in STATEFUL:
        parts.set("state.comm", lambda weights, optimizer, where: init_state(spec, weights, where),
                  by=NAME)
        parts.set("comm_specs", comm_specs, by=NAME)


def mean(spec, shapes=None):
    """(a device's gradient shards, its state, its rows' inputs) -> (their compressed mean over
    dp, state): the data region's mean (`shapes`: the shards it takes, if not all)."""
    from jaxscale.strategies.compression import methods
    kw = params(spec, shapes)
    return lambda grads, state, inputs: methods.compressed_mean(spec.compression, grads, state,
                                                                ("dp",), **kw)


def init_state(spec, weights, where):
    """The per-device state of the plan's method, [devices, ...] leaves (one slice per device,
    shaped by that device's gradient shards: `where` = the parameters' specs and axis sizes)."""
    if not active(spec) or spec.compression not in STATEFUL:
        return None
    import jax

    from jaxscale.strategies.compression import methods
    from jaxscale.strategies.dp import region
    specs, sizes = where
    if spec.sparse_embedding:
        specs = {k: v for k, v in specs.items() if k != "embed"}
        weights = {k: v for k, v in weights.items() if k != "embed"}
    local = jax.tree.map(lambda sp, a: jax.ShapeDtypeStruct(
        region.local_shape(a.shape, region.drop(sp, ("dp",)), sizes), a.dtype),
        specs, weights, is_leaf=_is_spec)
    state = methods.init_state(spec.compression, local, spec.deg("dp"), **params(spec))
    return region.stack_local(state, spec.n_devices)


def comm_specs(param_specs, comm, optimizer):
    """Every leaf of the per-device state: one slice per device (`region.stacked_spec`)."""
    import jax

    from jaxscale.strategies.dp import region
    return jax.tree.map(lambda _: region.stacked_spec(), comm)


def _is_spec(x) -> bool:
    from jax.sharding import PartitionSpec
    return isinstance(x, PartitionSpec)
