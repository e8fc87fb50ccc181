"""Pipeline stages: how many layers each holds, and where the stacked layers are stored.

`plan.stage_layers` gives the layers of each of the S = p v stages in pipeline order, as
comma-separated counts (`"3,5"`), or `auto`: the stages balanced by the planner's cost of a layer
against the embedding's on the first stage and the head's (and the loss's) on the last, so that
those stages hold fewer layers when that shortens the slowest stage (Llama 3 405B's 126 layers
on 16 stages: 7 on the first and the last, 8 on the others). With equal costs `auto` splits the
layers evenly.

Storage. A device holds its chunks (`Schedule.placement`: stage k on device k % p, or ZB-V's V)
as v blocks of `rows` = max(counts) rows each: stage s's layers fill the first counts[s] rows of
its block and the rest are padding (zeros, never read: no gradient reaches them, so AdamW leaves
them at zero). The stacked layers are then one [p v rows, ...] array split evenly over pp, in
the stored order `layer_order` (row -> model layer, -1 for padding; None when it is the model's
own order). Checkpoints hold the model's order without padding (`jaxscale.train.disk`), so a
checkpoint restores under any other stage layout, schedule or pp. No JAX here.
"""
from __future__ import annotations

import functools
import math

from jaxscale.strategies.pp.schedules import chunks, loop_placement, v_placement

AUTO = "auto"


def n_stages(spec) -> int:
    return spec.deg("pp") * chunks(spec.schedule, spec.virtual_stages)


def placement(spec) -> tuple[int, ...]:
    """The device of each stage (`schedules.Schedule.placement`)."""
    p, v = spec.deg("pp"), chunks(spec.schedule, spec.virtual_stages)
    return v_placement(p) if spec.schedule == "zb-v" else loop_placement(p, v)


def parse(value: str, n_layers: int, stages: int) -> tuple[int, ...]:
    """Explicit counts from `plan.stage_layers` (ValueError naming what is wrong and the fix)."""
    try:
        counts = tuple(int(x) for x in str(value).split(","))
    except ValueError:
        raise ValueError(f"plan.stage_layers={value!r}: give 'auto' or {stages} comma-separated "
                         f"layer counts, one per pipeline stage (e.g. "
                         f"{','.join(map(str, even(n_layers, stages)))})") from None
    if len(counts) != stages:
        raise ValueError(f"plan.stage_layers={value!r} names {len(counts)} stages, but the "
                         f"pipeline has {stages} (mesh.pp x virtual stages): give {stages} counts")
    if min(counts) < 1:
        raise ValueError(f"plan.stage_layers={value!r} leaves a stage empty: every stage needs "
                         f"at least one layer")
    if sum(counts) != n_layers:
        raise ValueError(f"plan.stage_layers={value!r} sums to {sum(counts)} layers, but "
                         f"model.n_layers={n_layers}: the counts must add up to it")
    return counts


def even(n_layers: int, stages: int) -> tuple[int, ...]:
    """As even as possible, the later stages one layer more where it does not divide."""
    base, extra = divmod(n_layers, stages)
    return tuple(base + (s >= stages - extra) for s in range(stages))


def balanced(n_layers: int, where: tuple[int, ...], first: float, last: float) -> tuple[int, ...]:
    """Counts minimising the busiest device, a layer costing 1, the first stage `first` more and
    the last stage `last` more (in layers); `where`: the device of each stage. The devices' totals
    are filled up to the lowest cap that holds every layer, the excess taken back from the
    costliest (earliest first); each device's total is split evenly over its stages, the later
    ones taking the remainder."""
    S, p = len(where), max(where) + 1
    own = [[s for s in range(S) if where[s] == d] for d in range(p)]
    extra = [0.0] * p
    extra[where[0]] += first
    extra[where[-1]] += last
    least = [len(o) for o in own]
    cap = math.ceil(n_layers / p)
    while sum(max(n, math.floor(cap + 1e-9 - e)) for n, e in zip(least, extra)) < n_layers:
        cap += 1
    total = [max(n, math.floor(cap + 1e-9 - e)) for n, e in zip(least, extra)]
    while sum(total) > n_layers:
        cost = [t + e if t > n else -math.inf for t, e, n in zip(total, extra, least)]
        total[cost.index(max(cost))] -= 1
    out = [0] * S
    for d, stages in enumerate(own):
        for s, n in zip(stages, even(total[d], len(stages))):
            out[s] = n
    return tuple(out)


def counts(spec) -> tuple[int, ...]:
    """The layers of each stage, in pipeline order (ValueError for a bad `plan.stage_layers`)."""
    S, L = n_stages(spec), spec.model.n_layers
    value = getattr(spec, "stage_layers", AUTO)
    if value != AUTO:
        return parse(value, L, S)
    if S == 1:
        return (L,)
    first, last = _edge_costs(spec)
    return balanced(L, placement(spec), first, last)


def _edge_costs(spec) -> tuple[float, float]:
    """The embedding's and the head's forward and backward cost in units of a layer's."""
    from jaxscale.models.layers import ONE_HOT_MAX_VOCAB
    from jaxscale.strategies.tables.flops import (
        head_flops_per_token,
        layer_flops_per_token,
        moe_rows,
    )
    m = spec.model
    layer = 3 * sum(layer_flops_per_token(m, spec.seq, spec.attention != "xla",
                                          *moe_rows(spec)).values())
    head = 3 * head_flops_per_token(m)
    embed = head_flops_per_token(m) if m.vocab_size <= ONE_HOT_MAX_VOCAB else 0.0
    return _round(embed / layer), _round(head / layer)


def _round(x: float) -> float:
    return round(x, 6)


def problems(spec) -> list[str]:
    if spec.deg("pp") == 1:
        if getattr(spec, "stage_layers", AUTO) not in (AUTO, str(spec.model.n_layers)):
            return [f"plan.stage_layers={spec.stage_layers!r} splits the layers into pipeline "
                    f"stages, but mesh.pp=1: set plan.stage_layers=auto or mesh.pp > 1"]
        return []
    S = n_stages(spec)
    if spec.model.n_layers < S:
        return [f"model.n_layers={spec.model.n_layers} is fewer than the {S} pipeline stages: "
                f"lower mesh.pp or plan.virtual_stages"]
    try:
        counts(spec)
    except ValueError as e:
        return [str(e)]
    return []


def rows(spec) -> int:
    """Stored rows of each chunk: the largest stage's layers."""
    return max(counts_or_even(spec))


def stored_layers(spec) -> int:
    """Rows of the stacked layers each device stores (its chunks' blocks, padding included)."""
    if spec.deg("pp") == 1:
        return spec.model.n_layers
    return chunks(spec.schedule, spec.virtual_stages) * rows(spec)


def device_layers(spec) -> list[int]:
    """The real layers each device holds (the sum of its stages')."""
    c, where = counts_or_even(spec), placement(spec)
    out = [0] * spec.deg("pp")
    for s, n in enumerate(c):
        out[where[s]] += n
    return out


def device_counts_or_even(spec) -> list[int]:
    """`device_layers`, for any plan the planner predicts (even stages where the layout is
    invalid; one device without a pipeline)."""
    return device_layers(spec) if spec.deg("pp") > 1 else [spec.model.n_layers]


def counts_or_even(spec) -> tuple[int, ...]:
    try:
        return counts(spec)
    except ValueError:                     # reported by `problems`; the planner still predicts
        return even(spec.model.n_layers, n_stages(spec))


def offsets(c: tuple[int, ...]) -> list[int]:
    """The model layer each stage starts at."""
    out, at = [], 0
    for n in c:
        out.append(at)
        at += n
    return out


def layer_order(spec) -> list[int] | None:
    """Stored row -> model layer (-1: padding) of the stacked layers under this plan; None for
    the model's own order without padding (one stage per device, equal counts)."""
    if spec.deg("pp") == 1:
        return None
    order = _order(counts(spec), placement(spec), spec.deg("pp"))
    return None if order is None else list(order)


def stored_order(spec) -> list[int]:
    """`layer_order` spelled out: stored row -> model layer, the model's own order included."""
    order = layer_order(spec)
    return list(range(spec.model.n_layers)) if order is None else order


@functools.lru_cache(maxsize=256)
def _order(c: tuple[int, ...], where: tuple[int, ...], p: int) -> tuple[int, ...] | None:
    r, start = max(c), offsets(c)
    order = []
    for d in range(p):
        own = [s for s in range(len(c)) if where[s] == d]
        for s in own:
            order += [start[s] + i if i < c[s] else -1 for i in range(r)]
    return None if order == list(range(sum(c))) else tuple(order)


def local_rows(spec, stage: int) -> tuple[int, int]:
    """(first stored row on its device, layers) of `stage`."""
    c, where = counts(spec), placement(spec)
    chunk = sum(1 for k in range(stage) if where[k] == where[stage])
    return chunk * max(c), c[stage]


def reorder(tree, saved: list[int] | None, wanted: list[int] | None, axis: int = 0):
    """`tree` (parameters, optimizer moments: any tree whose stacked layers sit under a "layers"
    key, along `axis`) with its layers moved from the stored order `saved` to `wanted`
    (`layer_order`s; None: the model's order without padding): rows of `wanted` that are padding
    (-1) come out zero. Traceable; eagerly, each array keeps its sharding (resized along the
    layers when the padding differs); a numpy array stays one."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    if saved == wanted or (saved is None and wanted is None):
        return tree
    real = next(len([r for r in o if r >= 0]) for o in (saved, wanted) if o is not None)
    saved = list(range(real)) if saved is None else list(saved)
    wanted = list(range(real)) if wanted is None else list(wanted)
    row_of = {layer: r for r, layer in enumerate(saved) if layer >= 0}
    take = np.array([row_of.get(layer, 0) for layer in wanted])
    keep = np.array([layer >= 0 for layer in wanted])

    def move(a):
        if a.ndim <= axis or a.shape[axis] != len(saved):
            raise ValueError(f"a stacked-layer array of shape {a.shape} has no {len(saved)} "
                             f"stored rows along axis {axis}")
        shape = a.shape[:axis] + (len(wanted),) + a.shape[axis + 1:]
        if isinstance(a, np.ndarray):           # on the host: numpy's own
            return _rows_moved(np, a, take, keep, axis)
        if isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer):
            return _mover(tuple(take.tolist()), tuple(keep.tolist()), axis,
                          fit(a.sharding, shape))(a)
        return _rows_moved(jnp, a, take, keep, axis)
    return jax.tree_util.tree_map_with_path(
        lambda path, a: move(a) if is_layers(path) else a, tree)


def _rows_moved(xp, a, take, keep, axis: int):
    """Rows `take` of `a` along `axis`, zero where not `keep` (numpy or jax.numpy as `xp`)."""
    import numpy as np
    out = xp.take(a, np.asarray(take), axis=axis)
    if all(keep):
        return out
    mask = xp.asarray(np.asarray(keep)).reshape((-1,) + (1,) * (a.ndim - 1 - axis))
    return xp.where(mask, out, xp.zeros_like(out))


@functools.lru_cache(maxsize=256)
def _mover(take: tuple, keep: tuple, axis: int, sharding):
    """The compiled move of eager arrays, one per (rows, sharding): a checkpoint's save and
    restore and the harness move every stacked leaf at each call."""
    import jax
    import jax.numpy as jnp
    return jax.jit(functools.partial(_rows_moved, jnp, take=take, keep=keep, axis=axis),
                   out_shardings=sharding)


def is_layers(path) -> bool:
    return any(getattr(k, "key", None) == "layers" for k in path)


def fit(sharding, shape):
    """`sharding` for an array of `shape`: a dimension its mesh axes do not divide is left whole
    (the model's layer count under a pipeline's padded layout may not divide over pp)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    if not isinstance(sharding, NamedSharding):
        return sharding
    sizes = dict(zip(sharding.mesh.axis_names, sharding.mesh.devices.shape))
    spec = list(sharding.spec) + [None] * (len(shape) - len(sharding.spec))
    for d, e in enumerate(spec):
        axes = () if e is None else (e,) if isinstance(e, str) else tuple(e)
        if shape[d] % math.prod(sizes[a] for a in axes):
            spec[d] = None
    return NamedSharding(sharding.mesh, P(*spec), memory_kind=sharding.memory_kind)
