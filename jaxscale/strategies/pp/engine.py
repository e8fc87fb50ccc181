"""The pipeline engine: the plan's schedule run over the `pp` mesh axis as a table of ticks.

`make_grads_fn` runs the tick table of `program.py` inside `jax.shard_map`, manual over `pp`
only (dp, fsdp, ep, sp and tp inside a stage stay GSPMD's, and the model's seams work there:
context attention, expert dispatch, the projection of QAT and collective matmul):

- a tick is one `lax.switch` per device on its branch (op, stage block, first or last stage?),
  then one collective-permute per ring the schedule uses (`up`: d -> d+1, `down`: d -> d-1),
  carrying each device's output (zeros when it sends nothing that way); an output whose next
  stage is on the same device (ZB-V's turn) is written to its slot there;
- the ops are `stage.py`'s: F (the first stage embeds the micro-batch's tokens, the last runs
  the final norm, the head and the loss with their backward, so the logits are never held across
  ticks), B, and W for the split schedules;
- the branches run inside `axes.divergent`: devices take different branches at once, which
  XLA:CPU's collective-permute cannot meet, so a permute inside a stage (ring attention,
  collective matmul) becomes an all-to-all there.

Weights of the embedding, final norm and head are replicated over pp; their gradients are summed
over pp (one all-reduce) at the end, with the loss, the token count, a mixture of experts'
statistics and a probe's cotangent (fp8 QAT's amaxes, combined by the probe's operation). The
batch comes through the plan's view first (context parallelism's zig-zag layout and positions),
once, and its micro-batches keep that layout between stages.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxscale.axes import constrain, current, divergent, manual
from jaxscale.models.layers import token_loss
from jaxscale.strategies import accumulate
from jaxscale.strategies.common import PROBE
from jaxscale.strategies.pp import stages as st
from jaxscale.strategies.pp.program import DOWN, FIELDS, UP, program_for
from jaxscale.strategies.pp.stage import Stage
from jaxscale.strategies.tables.activations import grouped


def make_grads_fn(model, placement, parts, forward_only: bool = False):
    """(params, batch, scale, *, probe=None) -> (token-mean gradients in fp32, loss, tokens,
    statistics) of `grads.make_grads_fn`'s contract, computed by the plan's pipeline schedule;
    `forward_only`: (params, batch) -> (sum of token losses, tokens), for evaluation."""
    spec, mesh = placement.spec, placement.mesh
    prog = program_for(spec, forward_only)
    m, split = prog.schedule.m, prog.schedule.split_backward
    starts = jnp.asarray(st.offsets(st.counts(spec)), jnp.int32)
    view, probe, moe = parts.batch_view, parts.probe, model.cfg.moe_experts > 0
    on_cpu = mesh.devices.flat[0].platform == "cpu"
    cfg = model.cfg       # a capacity-mode MoE layer's slot buffer: [experts, rows, C, ...]
    buffer = (cfg.moe_experts, cfg.moe_capacity(spec.seq)) if spec.moe and not grouped(spec) \
        else None
    param_spec = jax.tree_util.tree_map_with_path(
        lambda path, _: P("pp") if st.is_layers(path) else P(), model.abstract_params)
    col = {f: i for i, f in enumerate(FIELDS)}

    def body(params, batch, scale, probe_in):
        d = jax.lax.axis_index("pp")
        layers = params["layers"]
        outer = {k: val for k, val in params.items() if k != "layers"}
        micro = accumulate.split(batch, m)
        factor = scale / batch["targets"].size
        reg = jnp.sum(batch["mask"].astype(jnp.float32)) / m * factor if moe else 0.0
        ops = Stage(model, outer, parts.block_wrapper, split, reg)
        mod = lambda out: model.module({**out, "layers": layers})          # noqa: E731

        def block(row0, n):
            return jax.tree.map(lambda a: a[row0:row0 + n], layers)

        def micro_batch(j):
            mb = jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, j, keepdims=False), micro)
            return {k: constrain(val, "batch", "seq") for k, val in mb.items()}

        def embed(out, mb):
            return mod(out).embed_tokens(mb["inputs"])

        def head_loss(out, y, mb):
            total, n = token_loss(mod(out).logits(y), mb["targets"], mb["mask"])
            return total * factor, (total, n)

        def scales_of(stage, n):
            if probe_in is None:
                return None
            return jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, starts[stage], n),
                                probe_in)

        # what a forward keeps, per stage length: (residual structure, which are weights)
        mb0 = jax.eval_shape(micro_batch, 0)
        x_shape = jax.eval_shape(lambda mb: embed(outer, mb), mb0)
        lengths = sorted({b[2] for b in prog.branches if b[0] != "idle"})
        rows = max(lengths)
        with divergent(on_cpu):         # traced as the branches trace them
            if split:
                ops.trace(block(0, rows), x_shape, mb0)
            kept = {} if forward_only else {n: _residuals(ops, block(0, n), x_shape, mb0,
                                                          scales_of(0, n), rows_dim=n == rows)
                                            for n in lengths}
        zeros = lambda n, s: jnp.zeros((n, *s.shape), s.dtype)                # noqa: E731
        rules = current(mesh, placement.rules)[1]
        along = rules.spec(("batch", "norm_seq", "embed"))
        stream = lambda n: jax.lax.with_sharding_constraint(zeros(n, x_shape),  # noqa: E731
                                                            P(None, *along))
        layout = _token_layout(rules, buffer)
        buf = {"act": stream(prog.slots["act"]), "grad": stream(prog.slots["grad"]),
               "res": [] if forward_only else [_slots(prog.slots["res"], s, host, layout, at)
                                               for s, host, at in zip(*kept[rows][2:])],
               "tape": jax.tree.map(lambda s: zeros(prog.slots["tape"], s),
                                    jax.eval_shape(lambda: ops.zero_taps(rows)))
               if split and not forward_only else None}
        acc = {"layers": jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), layers),
               "outer": jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), outer),
               "loss": jnp.zeros((), jnp.float32), "tokens": jnp.zeros((), jnp.float32),
               "moe": jnp.zeros((4,), jnp.float32),
               "probe": None if probe_in is None else jax.tree.map(
                   lambda a: jnp.full(a.shape, -jnp.inf if probe.combine is jnp.maximum
                                      else 0.0, jnp.float32), probe_in)}
        no_send = jnp.zeros(x_shape.shape, x_shape.dtype)

        def add(tree, g, row0=None, n=None):
            """`tree` plus the gradients `g` (a sub-tree; None: nothing), in fp32, into rows
            row0..row0+n of the stacked layers when given."""
            if g is None:
                return tree
            if isinstance(tree, dict):
                return {k: add(v, g.get(k), row0, n) for k, v in tree.items()}
            g = g.astype(jnp.float32)
            return tree + g if row0 is None else tree.at[row0:row0 + n].add(g)

        def seen(acc, stage, n, cot):
            if cot is None or acc["probe"] is None:
                return acc
            rows_ = jax.tree.map(lambda a, c: probe.combine(
                jax.lax.dynamic_slice_in_dim(a, starts[stage], n), c.astype(a.dtype)),
                acc["probe"], cot)
            return {**acc, "probe": jax.tree.map(
                lambda a, r: jax.lax.dynamic_update_slice_in_dim(a, r, starts[stage], 0),
                acc["probe"], rows_)}

        def branch(kind, row0, n, first, last):
            """One op, reading the buffers at its slots, returning the values to write back at
            its slots (written outside: a switch returning whole buffers copies them), the
            accumulators and its output (what it sends or keeps)."""
            def run(idx, buf, acc):
                j, stage, inp, r, out, tp = idx
                mb, lay = micro_batch(j), block(row0, n)
                res = [b[r] for b in buf["res"]]               # unchanged unless F writes them
                g_store = buf["grad"][out]
                tape = None if buf["tape"] is None else jax.tree.map(lambda b: b[tp], buf["tape"])
                y = no_send
                if kind == "F":
                    x = embed(outer, mb) if first else buf["act"][inp]
                    if forward_only:
                        (y, _), stats = ops.run(lay, x, mb)
                    else:
                        (y, _), stats, vjp = ops.forward(lay, x, mb, scales_of(stage, n))
                        res = _store(kept[n], vjp, lay, res)
                    acc = {**acc, "moe": acc["moe"] + stats}
                    if last:
                        if forward_only:
                            _, (total, ntok) = head_loss(outer, y, mb)
                        else:
                            (_, (total, ntok)), (g_out, g_y) = jax.value_and_grad(
                                head_loss, (0, 1), has_aux=True)(outer, y, mb)
                            acc = {**acc, "outer": add(acc["outer"], g_out)}
                            g_store = g_y.astype(x.dtype)
                        acc = {**acc, "loss": acc["loss"] + total,
                               "tokens": acc["tokens"] + ntok}
                        y = no_send
                elif kind == "B":
                    vjp = _rebuild(kept[n], lay, res, buf["res"])
                    cot = ops.backward(vjp, buf["grad"][inp])
                    acc = {**acc, "layers": add(acc["layers"], cot["w"], row0, n)}
                    acc = seen(acc, stage, n, cot["scales"])
                    if split:
                        tape = jax.tree.map(lambda b, v: b.at[:n].set(v.astype(b.dtype)),
                                            tape, cot["taps"])
                    if first:
                        _, e_vjp = jax.vjp(lambda o: embed(o, mb), outer)
                        acc = {**acc, "outer": add(acc["outer"], e_vjp(cot["x"])[0])}
                    else:
                        y = cot["x"].astype(no_send.dtype)
                elif kind == "W":
                    mine = jax.tree.map(lambda b: b[inp][:n], buf["tape"])
                    g_w = ops.weights(lay, mine, scales_of(stage, n))
                    acc = {**acc, "layers": add(acc["layers"], g_w, row0, n)}
                return res, g_store, tape, acc, y
            return run

        fns = [branch(*b) for b in prog.branches]

        def receive(buf, name, got, slot):
            at = jnp.maximum(slot, 0)
            return {**buf, name: buf[name].at[at].set(jnp.where(slot >= 0, got, buf[name][at]))}

        def tick(carry, rows_):
            buf, acc = carry
            row = rows_[d]
            idx = tuple(jnp.maximum(row[col[f]], 0)
                        for f in ("mb", "stage", "inp", "res", "out", "tape"))
            with divergent(on_cpu):
                res, g_store, tape, acc, y = jax.lax.switch(row[col["branch"]], fns, idx, buf,
                                                            acc)
            _, _, _, r, out, tp = idx
            buf = {**buf, "grad": buf["grad"].at[out].set(g_store),
                   "res": [b.at[r].set(x) for b, x in zip(buf["res"], res)]}
            if tape is not None:
                buf["tape"] = jax.tree.map(lambda b, v: b.at[tp].set(v), buf["tape"], tape)
            send = row[col["send"]]
            buf = receive(buf, "act", y, row[col["keep_act"]])
            buf = receive(buf, "grad", y, row[col["keep_grad"]])
            for name, way in (("up", UP), ("down", DOWN)):
                if prog.rings[name]:
                    got = jax.lax.ppermute(jnp.where(send == way, y, no_send), "pp",
                                           list(prog.rings[name]))
                    buf = receive(buf, "act", got, row[col[f"{name}_act"]])
                    buf = receive(buf, "grad", got, row[col[f"{name}_grad"]])
            return (buf, acc), None

        (buf, acc), _ = jax.lax.scan(tick, (buf, acc), jnp.asarray(prog.table))
        loss, tokens = jax.lax.psum((acc["loss"], acc["tokens"]), "pp")
        if forward_only:
            return loss, tokens
        stats = {"moe": jax.lax.psum(acc["moe"], "pp")}
        if acc["probe"] is not None:
            stats[PROBE] = jax.tree.map(lambda a: jax.lax.pmax(a, "pp")
                                        if probe.combine is jnp.maximum
                                        else jax.lax.psum(a, "pp"), acc["probe"])
        grads = {**jax.lax.psum(acc["outer"], "pp"), "layers": acc["layers"]}
        return grads, loss, tokens, stats

    def manual_body(*args):
        # the stage's layout: the rules less pp, on this region's mesh; each stage its own layers
        with manual(("pp",), pieces=False):
            return body(*args)

    def run(params, batch, scale, probe_in=None):
        batch = view(batch) if view else batch
        out_specs = (P(), P()) if forward_only else (param_spec, P(), P(), P())
        here = current(mesh, placement.rules)[0]     # a data region's mesh, inside one
        return jax.shard_map(manual_body, mesh=here,
                             in_specs=(param_spec, {k: P() for k in batch}, P(), P()),
                             out_specs=out_specs, axis_names={"pp"}, check_vma=False)(
            params, batch, jnp.asarray(scale, jnp.float32), probe_in)

    if forward_only:
        return lambda params, batch: run(params, batch, 1.0)

    def grads_fn(params, batch, scale=1.0, *, probe=None):
        slots = batch["targets"].size
        grads, total, ntok, stats = run(params, batch, scale, probe)
        denom = jnp.where(ntok > 0, ntok, 1.0) / slots * scale
        grads = jax.tree.map(lambda g: g / denom, grads)
        out = {}
        if moe:
            aux, z, dropped, routed = stats["moe"]
            n = max(1, model.cfg.n_moe_layers) * m
            out = {"moe_aux_loss": aux / n, "moe_z_loss": z / n,
                   "moe_dropped": dropped / jnp.maximum(routed, 1.0)}
        if PROBE in stats:
            out[PROBE] = stats[PROBE]
        return grads, total / jnp.where(ntok > 0, ntok, 1.0), ntok, out
    return grads_fn


# ----------------------------------------------------------------------------- residual slots
def _token_layout(rules, buffer: tuple[int, int] | None):
    """(dims, at) -> the layout the stage gives a residual whose micro-batch rows are dimension
    `at` (entries per dimension, `P.UNCONSTRAINED` where it is free), or None for a residual
    without them (`at` None). A slot buffer of the layer stack ([layers, E, rows, C, ...]:
    `buffer` = (E, C)) has its experts over their axes and its rows over the batch's other axes
    (laid out by its rows alone they would take the experts' axes too, ep: every write and read
    an all-to-all); any other residual has its rows over the batch's axes."""
    both = rules.spec(("experts", "batch"))
    batch = rules.spec(("batch",))[0]

    def layout(dims, at):
        if at is None:
            return None
        out = [P.UNCONSTRAINED] * len(dims)
        if buffer is not None and at == 2 and (dims[1], dims[3]) == buffer:
            out[1], out[2] = both[0], both[1]
            return out
        if batch is None:
            return None
        out[at] = batch
        return out
    return layout


def _slots(n, shape, host: bool, layout, at):
    """n slots for a residual, in host memory for one the remat policy offloads. A residual of
    the micro-batch's tokens (its rows dimension `at`) is laid out in its slots as the stage
    computes it (`layout`, see `_token_layout`): left to GSPMD, the slots can take the weights'
    layout (the model dimension over fsdp) or split another dimension over a data axis (an odd
    kv head count's query group over fsdp, the batch over dp alone), and every write and read
    would reshard them with all-to-alls."""
    z = jnp.zeros((n, *shape.shape), shape.dtype)
    spec = layout(shape.shape, at)
    if spec is not None:
        z = jax.lax.with_sharding_constraint(z, P(None, *spec))
    return jax.device_put(z, jax.memory.Space.Host) if host else z


def _residuals(ops, lay, x_shape, mb, scales, rows_dim: bool = False):
    """(residual tree structure, for each residual the weight leaf it is or None, the shapes of
    the ones kept in slots, whether each is in host memory, the dimension of each that holds the
    micro-batch's rows or None) of a stage of these layers. The rows dimension (`rows_dim`: for
    the stage length the slots are shaped by; else None each) is the one that doubles with the
    micro-batch (traced again at twice its rows): read from the shapes alone it is ambiguous
    where another dimension has as many entries (a kv head's query group, the stage's layers)."""
    probe = {}

    def f(lay, x, mb, scales):
        _, _, vjp = ops.forward(lay, x, mb, scales)
        leaves, tree = jax.tree.flatten(vjp)
        weights = jax.tree.leaves(lay)
        where = tuple(next((i for i, w in enumerate(weights) if w is leaf), None)
                      for leaf in leaves)
        kept = [leaf for leaf, w in zip(leaves, where) if w is None]
        probe.update(tree=tree, where=where,
                     host=[jax.typeof(k).memory_space == jax.memory.Space.Host for k in kept])
        return kept
    shapes = jax.eval_shape(f, lay, x_shape, mb, scales)
    tree, where, host = probe["tree"], probe["where"], probe["host"]
    if not rows_dim:
        return tree, where, shapes, host, [None] * len(shapes)
    rows = x_shape.shape[0]
    wide = jax.tree.map(lambda a: jax.ShapeDtypeStruct((2 * rows, *a.shape[1:]), a.dtype),
                        (x_shape, mb))
    twice = jax.eval_shape(f, lay, *wide, scales)
    at = [next((i for i, (a, b) in enumerate(zip(s.shape, t.shape)) if a == rows and b == 2 * a),
               None) for s, t in zip(shapes, twice)]
    return tree, where, shapes, host, at


def _store(kept, vjp, lay, slots):
    """The forward's residuals, the stage's own weights left out, into slot-sized values (a
    shorter stage fills the first rows of a longer stage's slots)."""
    where = kept[1]
    leaves = [leaf for leaf, w in zip(jax.tree.leaves(vjp), where) if w is None]
    return [v if v.shape == s.shape else s.at[:v.shape[0]].set(v) for v, s in zip(leaves, slots)]


def _rebuild(kept, lay, res, slots):
    """The forward's vjp from the residual slots and the stage's weights."""
    tree, where, shapes = kept[:3]
    kept_iter = iter(r if r.shape == s.shape else r[:s.shape[0]] for r, s in zip(res, shapes))
    weights = jax.tree.leaves(lay)
    leaves = [weights[w] if w is not None else next(kept_iter) for w in where]
    return jax.tree.unflatten(tree, leaves)
