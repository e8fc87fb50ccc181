"""Host offload of train state: optimizer moments, fp32 master weights and/or working parameters
resident in host memory (`pinned_host` memory kind) between steps, and streamed through the
device by the optimizer update one layer at a time.

The step: the working parameters come to the device whole for the forward and backward (when
`params` is offloaded); the optimizer state and the master weights do not come over for them at
all. The update then runs as a loop over the layer-stacked leaves (`streamed_update`): iteration i
brings layer i of the moments, master weights and parameters to the device, applies the AdamW
update (clipped by the global gradient norm, computed once before the loop), sends the new values
back and writes them in place into the state's own (donated) host buffers; the next layer is
fetched as soon as this one is written (under ZeRO with the layers split over dp, one layer of
each device's own block per iteration). The embedding, head and final norm (not stacked) go one
leaf at a time, whole, after the loop: at most one layer's state, or one such leaf's, is on the
device at a time.

Memory: device-resident state falls by exactly the offloaded bytes (Adam moments alone are 8 of
the 16 bytes/param), and so does the device peak where the backward sets it (it holds none of
the offloaded state); the update phase holds the gradients plus one piece (a layer's state, its
update and its gradient slice in fp32, `piece_bytes`) instead of a copy of the whole state. Cost: each step moves every
offloaded byte to the device and back, 2 x offloaded bytes over PCIe (~25 GB/s per GPU, vs ~4 TB/s
HBM); the layer loop overlaps one layer's copies with the next layer's compute only partly (a
layer is fetched after the previous one is written), so the planner's step-time model charges
the traffic unhidden. Collectives: none added. Activation offload goes through the remat policy
(`plan.remat=offload`), not here.
"""
from __future__ import annotations

from jaxscale.strategies.common import Term, problems_of

NAME = "offload"
AVAILABLE = True
PARTS = ("optimizer", "master", "params")
HOST = "pinned_host"


def parse(spec: str) -> frozenset[str]:
    if spec in ("", "none"):
        return frozenset()
    parts = frozenset(p.strip() for p in spec.split("+"))
    bad = parts - set(PARTS)
    if bad:
        raise ValueError(f"unknown plan.offload part(s) {sorted(bad)}; valid: none, or "
                         f"{', '.join(PARTS)} joined with '+' (e.g. optimizer+master)")
    return parts


def memory_kind(part: str, parts: frozenset[str]) -> str | None:
    """Where a part of the train state lives between steps: host memory when offloaded."""
    return HOST if part in parts else None


def move(tree, shardings, parts: frozenset[str]):
    """Inside the step: `tree` to `shardings` (device memory on the way in, its home memory kind
    on the way out), whole; nothing to do when nothing is offloaded."""
    if tree is None or not parts:
        return tree
    import jax
    return jax.device_put(tree, shardings)


# ----------------------------------------------------------------------------- the streamed update
def _on_host(sharding) -> bool:
    return getattr(sharding, "memory_kind", None) == HOST


def pieces(n_layers: int, shardings) -> tuple[int, int]:
    """(iterations of the layer loop, layers each iteration takes): one layer per device per
    iteration. A leading dimension that ZeRO splits over `dp` (n ways) is taken n layers at a
    time, one from each device's own block, so no iteration moves a layer between devices."""
    import math
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
    import jax.numpy as jnp
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
    import jax
    import jax.numpy as jnp
    from jax import lax

    device, host = jax.memory.Space.Device, jax.memory.Space.Host

    def flat(tree):
        return jax.tree.flatten(tree, is_leaf=lambda x: x is None)

    A = [flat(a) for a in args]
    I = [flat(t)[0] for t in index]
    S = [flat(t)[0] if t is not None else [None] for t in arg_sh]
    O = [flat(t)[0] if t is not None else [None] for t in out_sh]
    n_args, n_out = len(A), len(out_like)

    def unflat(a, leaves):
        return jax.tree.unflatten(A[a][1], leaves) if A[a][0] != [None] else None

    def in_loop(j) -> bool:
        return j is not None and j >= 0 and j in stacked

    def piece_args(pick):
        """The arguments with `pick(a, p, leaf)` for every parameter-shaped leaf, the shared
        leaves whole, and `None` elsewhere."""
        return [unflat(a, [x if j == -1 else None if j is None else pick(a, p, x)
                           for p, (x, j) in enumerate(zip(A[a][0], I[a]))])
                for a in range(n_args)]

    def to_device(v, sh):
        return jax.device_put(v, device) if _on_host(sh) else v

    def to_home(v, sh):
        return jax.device_put(v, host) if _on_host(sh) else v

    outs_of = [(k, p) for k in range(n_out) for p, j in enumerate(I[out_like[k]])
               if j is not None and j >= 0]
    results = [[None] * len(I[out_like[k]]) for k in range(n_out)]

    # ---- the layer loop
    carried = [(k, p) for k, p in outs_of if in_loop(I[out_like[k]][p])]
    twin = {(out_like[k], p): c for c, (k, p) in enumerate(carried)}
    prev = (after,)
    if carried:
        loop = [(a, p) for a in range(n_args) for p, j in enumerate(I[a]) if in_loop(j)]
        lengths = {A[a][0][p].shape[0] for a, p in loop}
        if len(lengths) != 1:
            raise ValueError(f"layer-stacked leaves of different lengths {sorted(lengths)}")
        steps, width = pieces(lengths.pop(), [S[a][p] for a, p in loop] +
                              [O[k][p] for k, p in carried])
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
                                   O[k][p]) for b, (k, p) in zip(big, carried))

        def body(i, carry):
            big, cur = carry

            def pick(a, p, x):
                if not in_loop(I[a][p]):
                    return None
                if (a, p) in twin:
                    return cur[twin[(a, p)]]
                v = lax.dynamic_index_in_dim(split(x), i, axis, keepdims=False)
                return to_device(v, S[a][p])        # a read-only argument (the gradients)
            outs = [flat(o)[0] for o in fn(*piece_args(pick))]
            big = tuple(lax.dynamic_update_index_in_dim(b, to_home(outs[k][p], O[k][p]), i, axis)
                        for b, (k, p) in zip(big, carried))
            # the next layer, read after this one is written (the last iteration's is unused)
            return big, fetch(big, jnp.minimum(i + 1, steps - 1))

        big0 = tuple(split(A[out_like[k]][0][p]) for k, p in carried)
        big, _ = lax.fori_loop(0, steps, body, (big0, fetch(big0, _zero_after(after))))
        for (k, p), c in zip(carried, big):
            results[k][p] = merge(c)
        prev = big

    # ---- the other leaves, one after another, each whole
    rest = sorted({I[out_like[k]][p] for k, p in outs_of if not in_loop(I[out_like[k]][p])})
    for j in rest:
        keys = [(a, p) for a in range(n_args) for p, jj in enumerate(I[a]) if jj == j]
        # an optimization barrier orders this leaf's transfers after the previous piece's
        vals, _ = lax.optimization_barrier((tuple(A[a][0][p] for a, p in keys), prev))
        got = {key: to_device(v, S[key[0]][key[1]]) for key, v in zip(keys, vals)}
        outs = [flat(o)[0] for o in fn(*piece_args(lambda a, p, x: got.get((a, p))))]
        new = {(k, p): outs[k][p] for k, p in outs_of if I[out_like[k]][p] == j}
        for (k, p), v in new.items():
            results[k][p] = to_home(v, O[k][p])
        prev = tuple(new.values())

    # ---- the shared leaves (step counters): any piece computes the same
    outs = [flat(o)[0] for o in fn(*piece_args(lambda a, p, x: None))]
    final = []
    for k in range(n_out):
        leaves = [outs[k][p] if j == -1 else results[k][p] for p, j in enumerate(I[out_like[k]])]
        final.append(unflat(out_like[k], leaves))
    return tuple(final)


# ----------------------------------------------------------------------------- protocol
def active(spec) -> bool:
    return not problems(spec) and bool(parse(spec.offload))


def problems(spec) -> list[str]:
    errs = problems_of(parse, spec.offload)
    if errs:
        return errs
    if "master" in parse(spec.offload) and not spec.mixed:
        return [f"plan.offload includes 'master' but plan.precision={spec.precision} keeps no "
                f"separate fp32 master weights; offload 'params' or 'optimizer', or use bf16/fp16"]
    return []


def rules(spec, rules) -> None:
    """Offload adds no sharding rule (the state keeps its shardings, in host memory)."""


def collectives(spec) -> list:
    """None: the device<->host copies are PCIe transfers, charged by the planner's time model."""
    return []


def memory(spec) -> list[Term]:
    """Each offloaded part leaves device memory for host memory, byte for byte; and the update
    phase holds one streamed piece of it on the device."""
    if not active(spec):
        return []
    from jaxscale.strategies.precision import state_bytes
    state = state_bytes(spec)
    out = []
    for part in PARTS:
        if part in parse(spec.offload):
            out += [Term(part, -state[part], f"{part} offloaded to host memory"),
                    Term("host", state[part], f"{part} in host memory", part=part)]
    return out + [Term("update", piece_bytes(spec),
                       "one streamed piece: a layer's state, its update, its fp32 gradient")]


def piece_bytes(spec) -> float:
    """Device bytes of the largest piece of the streamed update, per device: one iteration of
    the layer loop (a layer of the working parameters, master weights and moments, and of the
    gradients in fp32), or the largest unstacked leaf (embedding or head) with the same parts.
    On XLA:CPU (one memory: a `device_put` of a slice is no copy) the update writes straight
    into the carry; on a GPU the host-homed parts' new values wait on the device for their copy
    back, one piece more of those parts."""
    from jaxscale.strategies.tables.params import leaves, shards
    from jaxscale.strategies import zero
    sh = shards(spec)
    moment = 4 if spec.mixed else spec.param_itemsize
    per_elem = {"params": spec.param_itemsize, "master": 4 if spec.mixed else 0,
                "optimizer": spec.moments * moment, "grads": 4}
    if spec.device_kind != "cpu":
        for part in parse(spec.offload):
            per_elem[part] = 2 * per_elem[part]
    elems = {"params": sh.params, "master": sh.optimizer, "optimizer": sh.optimizer,
             "grads": sh.optimizer}
    ls = leaves(spec.model)
    total = sum(leaf.size for leaf in ls)
    stacked = sum(leaf.size for leaf in ls if leaf.stacked)
    n_layers, dp = spec.model.n_layers, spec.deg("dp")
    # ZeRO splits the leading (layers) dimension over dp when nothing else takes it: each
    # iteration then takes one layer from each device's own block of layers
    width = dp if (zero.stage(spec) and dp > 1 and spec.deg("fsdp") == 1
                   and n_layers % dp == 0) else 1
    layer = sum(elems[k] * stacked / total * width / n_layers * b for k, b in per_elem.items())
    unstacked = max((leaf.size for leaf in ls if not leaf.stacked), default=0)
    leaf = sum(elems[k] * unstacked / total * b for k, b in per_elem.items())
    return float(max(layer, leaf))


def label(spec) -> list[str]:
    return [f"offload={spec.offload}"] if active(spec) else []
