"""Gradient compression over `dp`: the gradient mean computed by a compression method (`methods.py`,
`powersgd.py`) in `jax.shard_map` instead of XLA's fp32 all-reduce.

`plan.compression=bf16|fp8|int8|sign|topk|threshold|powersgd` (with `plan.compression_block`,
`_density`, `_threshold`, `_rank`). Each device computes the gradients of its own rows of the
batch (its micro-batches too); they are weighted by its share of the real tokens, so the mean
over devices is the token-mean gradient of the whole batch, as without compression; the mean
is computed by the method (quantised all-to-all + all-gather, top-k values + indices
all-gathered, PowerSGD's two small all-reduces, ...; see `methods.py`).
Collectives: those of the method, in place of the gradient all-reduce over dp, plus two scalar
all-reduces (tokens and loss). Saves: bytes on the wire (int8 about 1/4 of fp32's, top-k
k (index + value) per device, PowerSGD (n + m) r per matrix). Costs: the error of the method,
and for the error-feedback methods (sign, topk, threshold, powersgd) a per-device fp32 residual
the size of the gradients, carried in the train state and checkpointed (`TrainState.comm`).

Runs on data-parallel plans over `dp` alone (ZeRO 0 or 1): the method flattens the gradients into
one bucket, which would gather fsdp or tp shards.
"""
from __future__ import annotations

import math

from jaxscale.strategies.common import Comm, Term, dp_only
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
    return [leaf.shape for leaf in leaves(spec.model)]


def params(spec) -> dict:
    """The keyword arguments of `jaxscale.strategies.compression.methods.compressed_mean` for this
    plan."""
    m = spec.compression
    if m in ("fp8", "int8", "sign"):
        return {"block": spec.compression_block}
    if m in ("topk", "threshold"):
        k = max(1, int(spec.compression_density * sum(math.prod(s) for s in _sizes(spec))))
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
    errs += dp_only(spec, "plan.compression", "its one gradient bucket would gather their "
                    "shards", "plan.compression=none")
    if spec.zero >= 2:
        errs.append(f"plan.compression returns the whole mean gradient on every device, not the "
                    f"shards ZeRO-{spec.zero} keeps: use plan.zero=0 or 1")
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
    if not active(spec):
        return []
    rows = formulas.collectives(spec.compression, _sizes(spec), spec.deg("dp"), ("dp",),
                                **params(spec))
    return rows + [Comm("all-reduce", ("dp",), 4, 1, "token count (the loss denominator)",
                        group=spec.deg("dp"))]


def memory(spec) -> list[Term]:
    """The error-feedback residual: one fp32 copy of the gradients per device (sign: plus the
    residual of its shard of the mean; PowerSGD: plus its Q matrices)."""
    if not active(spec) or spec.compression not in STATEFUL:
        return []
    size = sum(math.prod(s) for s in _sizes(spec))
    extra = size / spec.deg("dp") if spec.compression == "sign" else 0
    if spec.compression == "powersgd":
        extra = sum(math.prod(s[:-2]) * s[-1] * spec.compression_rank for s in _sizes(spec)
                    if is_matrix(s, spec.compression_rank))
    return [Term("optimizer", 4 * (size + extra), f"{spec.compression} error-feedback state")]


def label(spec) -> list[str]:
    return [f"comp-{spec.compression}"] if active(spec) else []


# ----------------------------------------------------------------------------- the step side
def shape_step(spec, parts) -> None:
    """The step: the gradient mean over dp computed by the method in shard_map (`wrap`), its
    error-feedback state per device in `TrainState.comm`."""
    if not active(spec):
        return
    if spec.compression in STATEFUL:
        parts.set("state.comm", lambda params, optimizer: init_state(spec, params), by=NAME)
    parts.set("reduce", wrap, by=NAME)


def init_state(spec, abstract_params):
    """The stacked per-device state ([dp, ...] leaves) of the plan's method, or None."""
    if not active(spec) or spec.compression not in STATEFUL:
        return None
    from jaxscale.strategies.compression import methods
    n = spec.deg("dp")
    return methods.stack(methods.init_state(spec.compression, abstract_params, n,
                                            **params(spec)), n)


def wrap(grads_fn, placement, mean=None):
    """(params, batch, scale, state, *extra) -> (mean gradients, loss, tokens, stats, state):
    `grads_fn` (`train.grads.make_grads_fn`'s contract; `extra`, e.g. a distillation teacher's
    parameters, passed on to it, replicated) run on each device's rows inside `jax.shard_map`
    over dp, its token-mean gradients weighted by the device's share of the tokens, then averaged
    by the plan's method, or by `mean(grads, state, local batch) -> (mean, state)` when given
    (`strategies.sparse_embedding.mean`)."""
    import jax
    from jax.sharding import PartitionSpec as P

    from jaxscale.axes import suspended
    from jaxscale.strategies.compression import methods
    spec, mesh = placement.spec, placement.mesh
    n, kw = spec.deg("dp"), params(spec)

    def body(params_, batch, scale, state, *extra):
        with suspended():
            grads, loss, ntok, stats = grads_fn(params_, batch, scale, *extra)
        total = jax.lax.psum(ntok, "dp")
        weight = ntok * n / jax.numpy.where(total > 0, total, 1.0)
        local = None if state is None else jax.tree.map(lambda a: a[0], state)
        weighted = jax.tree.map(lambda g: g * weight, grads)
        if mean is None:
            avg, local = methods.compressed_mean(spec.compression, weighted, local, ("dp",),
                                                 **kw)
        else:
            avg, local = mean(weighted, local, batch)
        loss = jax.lax.psum(loss * ntok, "dp") / jax.numpy.where(total > 0, total, 1.0)
        stats = jax.tree.map(lambda s: jax.lax.pmean(s, "dp"), stats)
        state = None if local is None else jax.tree.map(lambda a: a[None], local)
        return avg, loss, total, stats, state

    def run(params_, batch, scale, state, *extra):
        st_spec = None if state is None else jax.tree.map(lambda _: P("dp"), state)
        rows = jax.tree.map(lambda _: P("dp"), batch)
        return jax.shard_map(body, mesh=mesh,
                             in_specs=(P(), rows, P(), st_spec) + (P(),) * len(extra),
                             out_specs=(P(), P(), P(), P(), st_spec), check_vma=False)(
            params_, batch, scale, state, *extra)
    return run
