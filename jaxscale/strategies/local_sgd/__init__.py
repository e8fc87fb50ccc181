"""Local SGD over `dp`: replicas that train apart for H steps, then average
(`jaxscale.strategies.local_sgd.averaging`).

`plan.local_sgd=local|post_local|slowmo|diloco`, `plan.local_steps` (H), `plan.local_warmup`
(post_local: synchronous steps first), `plan.outer_lr`, `plan.outer_momentum` (0 and -1: the
method's: local and post_local 1 and 0, SlowMo 1 and 0.5 heavy ball, DiLoCo 0.7 and 0.9 Nesterov).

The step runs in `jax.shard_map` manual over dp alone: each dp rank is a replica, an fsdp x tp
(x sp x ep) group whose layout inside stays GSPMD's (`axes.manual`), so a replica may itself be
sharded (DiLoCo islands that are FSDP/TP groups). Each takes its rows of the batch, its own fp32
copy of the parameters and its own inner optimizer state (the plan's `optim`), and updates them
with no collective over dp on the way; every H-th step (a `lax.switch` branch) one all-reduce over
dp of the fp32 parameter changes averages them (each device its shard), the outer optimizer moves
the anchor and the replicas restart from it. post_local's warmup steps take a third branch, DP's
step: the token-mean gradient all-reduced, the same update on every replica (AdamW's state
included), no average needed.
Collectives per step: that all-reduce, 4 Psi bytes once every H steps (on average 4 Psi / H),
plus one small all-reduce of the step's metrics (loss x tokens, tokens, gradient norm, non-finite
and spike flags: 20 bytes) that no local update waits for; post_local's warmup moves DP's 4 Psi
a step.
Saves: H times fewer bytes than DP's gradient all-reduce, and H times fewer latencies (the link
can be slow: across data centres for DiLoCo). Costs: the replicas drift apart between averages
(convergence per step suffers as H grows; the outer momentum buys some back), and memory.
Memory per device: the anchor (`TrainState.params`, and `master` with 16-bit policies: what
eval, checkpoints and exports read), the replica (fp32, 4 Psi / its replica's split) and its inner
optimizer state (`TrainState.comm`, [dp, ...] over dp, each replica laid out as the parameters),
and the outer momentum (4 Psi, the parameters' layout; `TrainState.opt_state`, empty for plain
averaging). Between averages the anchor is the model of
the last average; the reported loss is the replicas' token-mean loss on their own rows, and the
gradient norm the mean of the replicas' norms. A replica whose step is not finite keeps its state
(its own decision: no collective before a local update); loss scaling halves if any overflowed.
With pruning, each replica is masked after its inner update and the anchor after each average.

Streaming (Streaming DiLoCo, arXiv 2501.18512; `fragments.py`): `plan.outer_fragments=F` cuts
the model into F strided layer fragments (F need not divide the layers: then they differ by a
layer), each averaged once every H steps at its own offset, so a step all-reduces at most one
fragment's bytes, about 4 Psi / F (the same 4 Psi / H per step on average: the peak falls
F-fold, to the largest group's); `plan.outer_delay=1` takes each average from the replica as
the step starts, so its all-reduce depends on nothing the step computes and overlaps the
step's forward and backward (each branch of the switch then holds the whole step), and lands at
the step's end, where the replica's parts are merged, `plan.outer_mix` (alpha, 0.5) x its own
+ (1 - alpha) x the new anchor: the outer update is one step late, the link is never waited on.
An XLA collective starts and ends inside one compiled step, so one step is the most it can
overlap.

With `plan.compression` the average is the method's compressed mean of the changes
(`replicas.outer_mean`; its per-device state in `TrainState.comm["mean"]`: streamed, one state
per fragment group, of the group's parts), its collectives in place of the fp32 all-reduce
(`compression.mean_collectives` of each group's shards, at 1/H).
With `plan.offload` the parts of the state it names live in host memory between steps: the
outer optimizer's state ("optimizer": touched once every H steps, as OpenDiLoCo keeps it on the
CPU), the anchor ("master", or "params" in fp32); they come to the device whole for the step
(`outer_state_bytes`: what the planner moves). The replicas and their inner optimizer state, used
by every inner step, stay on the device.
Needs ZeRO 0: ZeRO would split over dp one optimizer state that the dp ranks no longer share
(each replica has its own).
"""
from __future__ import annotations

import dataclasses
import math

from jaxscale.strategies.common import Comm, Term

NAME = "local_sgd"
AVAILABLE = True
SWITCH_OUTER = True     # its step's switch holds the whole step (a pipeline's engine inside)
METHODS = ("local", "post_local", "slowmo", "diloco")
#: (outer lr, outer momentum, Nesterov) by method
DEFAULTS = {"local": (1.0, 0.0, False), "post_local": (1.0, 0.0, False),
            "slowmo": (1.0, 0.5, False), "diloco": (0.7, 0.9, True)}
#: floats of the step's metrics all-reduce (loss x tokens, tokens, gradient norm, non-finite,
#: spiked: the replicas whose loss was above `train.spike_policy=skip`'s limit)
METRICS = 5


def active(spec) -> bool:
    return spec.local_sgd != "none"


def hparams(spec) -> tuple[float, float, bool]:
    """(outer lr, outer momentum, Nesterov) of the plan: its options, else the method's."""
    lr, mom, nesterov = DEFAULTS[spec.local_sgd]
    return (spec.outer_lr if spec.outer_lr > 0 else lr,
            spec.outer_momentum if spec.outer_momentum >= 0 else mom, nesterov)


def problems(spec) -> list[str]:
    if not active(spec):
        return ([] if not streaming(spec) else
                [f"plan.outer_fragments={spec.outer_fragments} and plan.outer_delay="
                 f"{spec.outer_delay} stream local SGD's averages: set plan.local_sgd (e.g. "
                 f"diloco), or leave them at 1 and 0"])
    if spec.local_sgd not in METHODS:
        return [f"plan.local_sgd={spec.local_sgd!r}: valid are none, {', '.join(METHODS)}"]
    m, errs = spec.local_sgd, []
    if spec.local_steps < 1:
        errs.append(f"plan.local_steps={spec.local_steps}: the replicas average every H >= 1 "
                    f"steps; use plan.local_steps=1 (every step) or more")
    if spec.deg("dp") == 1:
        errs.append(f"plan.local_sgd={m} trains replicas over mesh.dp, but mesh.dp=1: give the "
                    f"devices to dp (e.g. mesh.dp=8), or set plan.local_sgd=none")
    if spec.zero >= 1:
        errs.append(f"plan.local_sgd gives each dp rank its own replica and inner optimizer "
                    f"state; ZeRO-{spec.zero} would split one optimizer state over those ranks: "
                    f"use plan.zero=0 (mesh.fsdp shards each replica instead)")
    if m == "post_local" and spec.local_warmup < 1:
        errs.append("plan.local_sgd=post_local needs plan.local_warmup >= 1 synchronous steps "
                    "before it goes local (or use plan.local_sgd=local)")
    if m != "post_local" and spec.local_warmup > 0:
        errs.append(f"plan.local_warmup={spec.local_warmup} applies to plan.local_sgd=post_local "
                    f"only: set it to 0, or use post_local")
    errs += streaming_problems(spec)
    if m in ("local", "post_local") and (spec.outer_lr not in (0, 1) or spec.outer_momentum > 0):
        errs.append(f"plan.local_sgd={m} averages the replicas (outer lr 1, momentum 0): for an "
                    f"outer learning rate or momentum use plan.local_sgd=slowmo or diloco")
    return errs


def streaming(spec) -> bool:
    """Whether the averages stream: fragments, or each one overlapping the next inner step."""
    return spec.outer_fragments > 1 or spec.outer_delay > 0


def streaming_problems(spec) -> list[str]:
    """Fragments need a layer each (F <= the layers); under a pipeline a fragment takes its
    layers from every stage that holds some (`fragments.py`), so no more than that."""
    F, model, errs = spec.outer_fragments, spec.model, []
    if F > model.n_layers:
        errs.append(f"plan.outer_fragments={F} is more than the {model.n_layers} layers: at "
                    f"most one fragment per layer")
    return errs


def rules(spec, rules) -> None:
    """Local SGD adds no sharding rule: replicas live on their dp rows (`TrainState.comm`)."""


def collectives(spec) -> list[Comm]:
    """Per step on average: 1/H of one fp32 all-reduce of the parameters, and the metrics."""
    if not active(spec):
        return []
    n, H = spec.deg("dp"), max(1, spec.local_steps)
    when = "as the next step runs" if spec.outer_delay else "blocking"
    whose = lambda g: ("parameter changes" if not streaming(spec) else
                       f"fragment group {g} of {spec.outer_fragments}'s changes")
    if spec.compression == "none":
        average = [Comm("all-reduce", ("dp",), b / H, 1, f"{whose(g)} averaged once every H={H} "
                        f"steps (fp32; per step 1/H of it), {when}", group=n,
                        overlap=bool(spec.outer_delay))
                   for g, b in enumerate(average_bytes(spec))]
    else:                           # the method's compressed mean of each group's changes
        from jaxscale.strategies import compression
        from jaxscale.strategies.local_sgd import fragments
        average = [dataclasses.replace(
            c, bytes=c.bytes / H, overlap=bool(spec.outer_delay),
            what=f"{c.what}: {whose(g)}' compressed average once every H={H} steps (per step "
                 f"1/H of it), {when}")
            for g, shapes in enumerate(fragments.group_shapes(spec))
            for c in compression.mean_collectives(spec, shapes)]
    return average + [
            Comm("all-reduce", ("dp",), 4 * (METRICS + 3 * spec.moe), 1,
                 "the step's metrics: loss x tokens, tokens, gradient norm, non-finite flag"
                 + (", the 3 router metrics" if spec.moe else ""),
                 group=n)]


def average_bytes(spec) -> list[float]:
    """The fp32 bytes per device one average all-reduces, for each kind of averaging step: the
    whole replica, or streaming's fragment groups in offset order (`fragments.group_shapes`; the
    largest is the peak a step puts on the link)."""
    from jaxscale.strategies.local_sgd import fragments
    return [4.0 * sum(math.prod(s) for s in g) for g in fragments.group_shapes(spec)]


def memory(spec) -> list[Term]:
    """The replica's fp32 parameters beside the anchor, and the outer momentum (if any); the
    replica's inner optimizer state is the size of the plan's optimizer state (counted there).
    A blocking average holds five fp32 copies of the replica at once (read from XLA:CPU's live
    ranges: the changes, their all-reduced sum, the mean, the outer step's two results), four
    beyond the update phase's gradient buffer. A streamed average (`fragments`) cuts its group's
    parts out of the whole leaves and puts them back into both the anchor and the replica, each
    put a whole new leaf beside the old: read from the same live ranges (dp8, F = 2 and 4),
    blocking's four copies and 3.75 (1 - 1/F) more, or 3.5 + 2.25 (1 - 1/F) delayed (the step's
    own update no longer waits beside the average's copies). Delayed, the new anchor (and outer
    momentum) depends on the average alone: XLA computes it as the step starts and holds it, two
    whole fp32 leaves each, through the backward. One more replica-sized fp32 buffer: blocking
    with an 8-bit method, the dequantized mean beside the changes (dp8, dp4 x tp2: 1.00 replica
    above the plain average's); streamed with PowerSGD, the reconstruction (1.09)."""
    if not active(spec):
        return []
    from jaxscale.strategies.tables.params import leaves
    size = sum(leaf.local_size(spec) for leaf in leaves(spec.model))
    _, mom, _ = hparams(spec)
    out = [Term("params", 4 * size, "this device's replica of the parameters (fp32)")]
    if mom > 0:
        out.append(Term("optimizer", 4 * size, "outer momentum (fp32)"))
    if not streaming(spec):
        out.append(Term("update", 4 * 4 * size, "the average: the changes, their sum, the mean "
                        "and the outer step's results (fp32, with the gradient buffer five "
                        "copies)"))
    else:
        cut = 1 - 1 / spec.outer_fragments
        copies = 3.5 + 2.25 * cut if spec.outer_delay else 4 + 3.75 * cut
        out.append(Term("update", copies * 4 * size, f"a streamed average: its group's parts "
                        f"cut out and put back into the anchor and the replica ({copies:.2f} "
                        f"fp32 replicas)"))
        if spec.outer_delay and spec.outer_fragments > 1:
            out.append(Term("backward", 4 * size * (1 + (mom > 0)), "the delayed average's new "
                            "anchor (and outer momentum), computed as the step starts"))
    if spec.compression in (("powersgd",) if streaming(spec) else ("int8", "fp8")):
        out.append(Term("update", 4 * size, f"{spec.compression}: its result beside the changes"))
    return out


def outer_state_bytes(spec) -> float:
    """Per-device bytes of the outer optimizer's state (`TrainState.opt_state`): the fp32 outer
    momentum, or nothing for plain averaging."""
    from jaxscale.strategies.tables.params import leaves
    _, mom, _ = hparams(spec)
    return 4 * sum(leaf.local_size(spec) for leaf in leaves(spec.model)) if mom > 0 else 0.0


def label(spec) -> list[str]:
    if not active(spec):
        return []
    return [f"{spec.local_sgd}-H{spec.local_steps}"
            + (f"-F{spec.outer_fragments}" if spec.outer_fragments > 1 else "")
            + ("-delayed" if spec.outer_delay else "")]


def branch_share(spec) -> list[float]:
    """How often each branch of the step's `lax.switch` runs (inner step; inner step and
    average, or streaming's one per fragment group; post_local's synchronous step) after the
    warmup: what `hlo.Module` weighs the census
    and FLOPs by."""
    H = max(1, spec.local_steps)
    G = len(average_bytes(spec))        # streaming: one branch per group of fragments
    return [1 - G / H] + [1 / H] * G + ([0.0] if spec.local_warmup > 0 else [])


# ----------------------------------------------------------------------------- the step side
def shape_step(spec, parts) -> None:
    """The step: this strategy's own (`make_train_step`), the replicas and their inner optimizer
    states per device in `TrainState.comm`, the outer optimizer's state in `opt_state`."""
    if not active(spec):
        return
    from jaxscale.strategies.local_sgd.replicas import make_train_step
    parts.set("train_step", lambda ctx: make_train_step(spec, ctx, outer_optimizer(spec),
                                                        METRICS), by=NAME)
    parts.set("state.comm", lambda params, optimizer, where: init_state(spec, params, optimizer,
                                                                        where), by=NAME)
    parts.set("comm_specs", comm_specs, by=NAME)
    parts.set("state_optimizer", lambda optimizer: outer_optimizer(spec), by=NAME)


def comm_specs(param_specs, comm, optimizer):
    """The replicas and their inner optimizer states: [dp, ...], each replica laid out as the
    parameters (its moments as the parameters they update, its counters whole)."""
    import jax
    import optax
    from jax.sharding import PartitionSpec as P
    rep = jax.tree.map(lambda sp: P("dp", *sp), param_specs, is_leaf=lambda x: isinstance(x, P))
    opt = optax.tree_map_params(optimizer, lambda _, sp: sp, comm["opt_state"], rep,
                                transform_non_params=lambda _: P("dp"))
    out = {"params": rep, "opt_state": opt}
    if "mean" in comm:          # the compressed outer mean's per-device state
        from jaxscale.strategies import compression
        out["mean"] = compression.comm_specs(param_specs, comm["mean"], optimizer)
    return out


def outer_optimizer(spec):
    """The outer optimizer of the plan's method (its state is `TrainState.opt_state`)."""
    from jaxscale.strategies.local_sgd import averaging
    return averaging.outer_optimizer(*hparams(spec))


def init_state(spec, params, optimizer, where):
    """{"params": replicas, "opt_state": their inner optimizer states}, [dp, ...] leaves (each
    replica a copy of `params` in fp32); with a stateful `plan.compression`, "mean": the
    compressed outer mean's state, one slice per device (`compression.init_state`)."""
    import jax
    import jax.numpy as jnp

    from jaxscale.strategies import compression
    from jaxscale.strategies.local_sgd import averaging, fragments
    rep = {"params": jax.tree.map(lambda a: a.astype(jnp.float32), params)}
    rep["opt_state"] = optimizer.init(rep["params"])
    out = averaging.stack(rep, spec.deg("dp"))
    if streaming(spec):                         # one state per fragment group, of its parts
        held = [compression.init_state(spec, *part)
                for part in fragments.group_parts(spec, params, where)]
        held = None if held[0] is None else held
    else:
        held = compression.init_state(spec, params, where)
    if held is not None:
        out["mean"] = held
    return out
