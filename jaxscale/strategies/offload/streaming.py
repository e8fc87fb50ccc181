"""The update of an offloaded train state, streamed through the device one layer at a time.

`streamed_update` computes an element-wise map of the state (the optimizer update) piece by
piece: one layer of every layer-stacked leaf per iteration of a loop, then each other leaf whole;
`streamed` is the step's update built on it (`StepParts.update`). See `offload/__init__.py` for
what it saves and costs.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jaxscale.strategies.common import keep_if_finite


def _on_host(sharding) -> bool:
    """Whether a part lives outside device memory between steps (`pinned_host`)."""
    return getattr(sharding, "memory_kind", None) not in (None, "device")


def pieces(n_layers: int, shardings) -> tuple[int, int]:
    """(iterations of the layer loop, layers each iteration takes): one layer per device per
    iteration. A leading dimension that ZeRO splits over `dp` (n ways) is taken n layers at a
    time, one from each device's own block, so no iteration moves a layer between devices."""
    n = 1
    for sh in shardings:
        first = (tuple(getattr(sh, "spec", ())) or (None,))[0]
        axes = () if first is None else (first,) if isinstance(first, str) else first
        n = math.lcm(n, math.prod(sh.mesh.shape[a] for a in axes))
    if n_layers % n:
        raise ValueError(f"offload streams the update layer by layer, but {n_layers} layers do "
                         f"not split into the {n} ways the state's leading dimension is sharded")
    return n_layers // n, n


def _zero_after(x):
    """0, computed from `x`: an index that makes what it addresses wait for `x` (XLA may
    otherwise hoist a read that depends on nothing else to the start of the step). The first
    of [True, anything] is a maximum whatever `x` is, so argmax gives 0, but XLA cannot fold it."""
    if x is None:
        return jnp.int32(0)
    return jnp.argmax(jnp.stack([jnp.bool_(True), jnp.isnan(x)])).astype(jnp.int32)


def streamed_update(fn, args, arg_sh, out_sh, out_like, index, stacked, after=None):
    """`fn(*args)` computed piece by piece: one layer of every layer-stacked leaf per iteration of
    a loop, then each other leaf (embedding, head, final norm) whole, one after another.

    fn        an element-wise map of the state (the optimizer update) that accepts any piece of
              it: trees with `None` where a leaf is not in the piece, returned with `None` there;
              leaves not shaped like a parameter (step counters) go to every piece whole;
    args      trees (or `None`); arg_sh / out_sh: NamedShardings of where each argument lives and
              where each output lives (host-resident ones are `pinned_host`);
    out_like  for each output, the argument it replaces (same structure, same memory kind): a
              stacked output is written in place into its argument's buffer, layer by layer;
    index     per argument, a tree of parameter-leaf numbers (-1: shared by every piece);
    stacked   the parameter-leaf numbers with a leading `layers` dimension;
    after     a scalar the loop waits for (the gradients' norm): the first layer is fetched once
              it is known, not while the backward still runs.

    Iteration i applies `fn` to layer i as the previous iteration fetched it (`device_put` to
    device memory), sends the host-homed results back (`device_put` to host memory), writes them
    into the carry (a dynamic-update-slice) and only then fetches layer i + 1 from the updated
    carry: one layer's state is on the device at a time, no reader of the old carry is left when
    it is written (XLA would copy the carry otherwise), the new state takes the old's buffers.
    """

    device, host = jax.memory.Space.Device, jax.memory.Space.Host

    def flat(tree):
        return jax.tree.flatten(tree, is_leaf=lambda x: x is None)

    A = [flat(a) for a in args]
    idx = [flat(t)[0] for t in index]
    S = [flat(t)[0] if t is not None else [None] for t in arg_sh]
    out_shs = [flat(t)[0] if t is not None else [None] for t in out_sh]
    n_args, n_out = len(A), len(out_like)

    def unflat(a, leaves):
        return jax.tree.unflatten(A[a][1], leaves) if A[a][0] != [None] else None

    def in_loop(j) -> bool:
        return j is not None and j >= 0 and j in stacked

    def piece_args(pick):
        """The arguments with `pick(a, p, leaf)` for every parameter-shaped leaf, the shared
        leaves whole, and `None` elsewhere."""
        return [unflat(a, [x if j == -1 else None if j is None else pick(a, p, x)
                           for p, (x, j) in enumerate(zip(A[a][0], idx[a]))])
                for a in range(n_args)]

    def to_device(v, sh):
        return jax.device_put(v, device) if _on_host(sh) else v

    def to_home(v, sh):
        return jax.device_put(v, host) if _on_host(sh) else v

    outs_of = [(k, p) for k in range(n_out) for p, j in enumerate(idx[out_like[k]])
               if j is not None and j >= 0]
    results = [[None] * len(idx[out_like[k]]) for k in range(n_out)]

    # ---- the layer loop
    carried = [(k, p) for k, p in outs_of if in_loop(idx[out_like[k]][p])]
    twin = {(out_like[k], p): c for c, (k, p) in enumerate(carried)}
    prev = (after,)
    if carried:
        loop = [(a, p) for a in range(n_args) for p, j in enumerate(idx[a]) if in_loop(j)]
        lengths = {A[a][0][p].shape[0] for a, p in loop}
        if len(lengths) != 1:
            raise ValueError(f"layer-stacked leaves of different lengths {sorted(lengths)}")
        steps, width = pieces(lengths.pop(), [S[a][p] for a, p in loop] +
                              [out_shs[k][p] for k, p in carried])
        axis = 0 if width == 1 else 1

        # [L, ...] -> [width, steps, ...] (a free reshape: device d's own block of layers is
        # row d), so iteration i takes column i: one layer from each device's block
        def split(x):
            return x if width == 1 else x.reshape((width, steps) + x.shape[1:])

        def merge(x):
            return x if width == 1 else x.reshape((width * steps,) + x.shape[2:])

        def fetch(big, i):
            """Layer i of every carried leaf, on the device."""
            return tuple(to_device(lax.dynamic_index_in_dim(b, i, axis, keepdims=False),
                                   out_shs[k][p]) for b, (k, p) in zip(big, carried))

        def body(i, carry):
            big, cur = carry

            def pick(a, p, x):
                if not in_loop(idx[a][p]):
                    return None
                if (a, p) in twin:
                    return cur[twin[(a, p)]]
                v = lax.dynamic_index_in_dim(split(x), i, axis, keepdims=False)
                return to_device(v, S[a][p])        # a read-only argument (the gradients)
            outs = [flat(o)[0] for o in fn(*piece_args(pick))]
            big = tuple(lax.dynamic_update_index_in_dim(b, to_home(outs[k][p], out_shs[k][p]), i,
                                                        axis)
                        for b, (k, p) in zip(big, carried))
            # the next layer, read after this one is written (the last iteration's is unused)
            return big, fetch(big, jnp.minimum(i + 1, steps - 1))

        big0 = tuple(split(A[out_like[k]][0][p]) for k, p in carried)
        big, _ = lax.fori_loop(0, steps, body, (big0, fetch(big0, _zero_after(after))))
        for (k, p), c in zip(carried, big):
            results[k][p] = merge(c)
        prev = big

    # ---- the other leaves, one after another, each whole
    rest = sorted({idx[out_like[k]][p] for k, p in outs_of if not in_loop(idx[out_like[k]][p])})
    for j in rest:
        keys = [(a, p) for a in range(n_args) for p, jj in enumerate(idx[a]) if jj == j]
        # an optimization barrier orders this leaf's transfers after the previous piece's
        vals, _ = lax.optimization_barrier((tuple(A[a][0][p] for a, p in keys), prev))
        got = {key: to_device(v, S[key[0]][key[1]]) for key, v in zip(keys, vals)}
        outs = [flat(o)[0] for o in fn(*piece_args(lambda a, p, x: got.get((a, p))))]
        new = {(k, p): outs[k][p] for k, p in outs_of if idx[out_like[k]][p] == j}
        for (k, p), v in new.items():
            results[k][p] = to_home(v, out_shs[k][p])
        prev = tuple(new.values())

    # ---- the shared leaves (step counters): any piece computes the same
    outs = [flat(o)[0] for o in fn(*piece_args(lambda a, p, x: None))]
    final = []
    for k in range(n_out):
        leaves = [outs[k][p] if j == -1 else results[k][p] for p, j in enumerate(idx[out_like[k]])]
        final.append(unflat(out_like[k], leaves))
    return tuple(final)


def streamed(ctx):
    """The optimizer update of an offloaded state (`StepParts.update`'s contract: (grads, norm,
    finite, state, device params) -> (params, optimizer state, master)), by `streamed_update`:
    one layer's offloaded state on the device at a time, the working parameters written in place
    where they live; a skipped step leaves every piece as it was; `parts.after_update` (pruning)
    applied to each piece."""
    lay, host_sh, policy = ctx.lay, ctx.host_sh, ctx.policy
    master = lay.master
    after = ctx.parts.after_update(ctx) if ctx.parts.after_update else None    # pruning

    def run(grads, norm, finite, state, params):
        def piece(grads, opt_state, master_, params):
            old = (opt_state, master_ if master else params)
            new_opt, target = keep_if_finite(finite, ctx.apply_update((grads, norm), old), old)
            if after is not None:       # this piece's weights, masked as they pass through
                target = after(target, state.step + finite)
            return policy.working(target), new_opt, target if master else None

        opt_index = optax.tree_map_params(ctx.optimizer, lambda _, j: j, state.opt_state,
                                          ctx.param_index, transform_non_params=lambda _: -1)
        return streamed_update(
            piece, (grads, state.opt_state, state.master, state.params),
            arg_sh=(ctx.grads_sh, host_sh.opt_state, host_sh.master, host_sh.params),
            out_sh=(host_sh.params, host_sh.opt_state, host_sh.master), out_like=(3, 1, 2),
            index=(ctx.param_index, opt_index, ctx.param_index if master else None,
                   ctx.param_index),
            stacked=ctx.stacked, after=norm)
    return run
