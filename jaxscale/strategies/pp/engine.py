"""The pipeline engine: the plan's schedule run over the `pp` mesh axis as a table of ticks.

`make_grads_fn` runs the tick table of `program.py` inside `jax.shard_map`, manual over `pp`
only (dp, fsdp and tp inside a stage stay GSPMD's):

- a tick is one `lax.switch` per device on (op, chunk, first stage?, last stage?), then at most one
  `ppermute` forward (stage outputs to the next stage's device, `d -> d+1 mod p`) and one backward
  (input gradients to the previous stage's device), listing only the devices that send then;
- F: the stage input (the embedding of the micro-batch's tokens on the first stage, else a
  received activation) through the stage's layers by `jax.vjp`; its residuals (what the remat
  policy saves) are stored in a slot until the backward, except those that are the stage's own
  weights, which are taken from the weights again. The last stage also runs the final norm, the
  head and the loss, with their backward, so the logits are never held across ticks;
- B: the stored residuals and the received output gradient give the input gradient (sent back,
  or into the embedding on the first stage) and the weight gradients; ZB-H1 splits it: B keeps
  only the input gradient, W (later) only the weight gradients, from the same residuals and
  output gradient (so W repeats the in-stage backward chain: JAX's vjp does not split per matmul).

Weights of the embedding, final norm and head are replicated over pp; their gradients are summed
over pp (one all-reduce) at the end, with the loss.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxscale.axes import constrain, current, manual
from jaxscale.models.layers import token_loss
from jaxscale.strategies import accumulate
from jaxscale.strategies.pp.program import FIELDS, _is_layers, program_for


def make_grads_fn(model, placement, block_wrapper=None, forward_only: bool = False):
    """(params, batch, scale) -> (token-mean gradients in fp32, loss, tokens, {}) of
    `grads.make_grads_fn`'s contract, computed by the plan's pipeline schedule; `forward_only`:
    (params, batch) -> (sum of token losses, tokens), for evaluation."""
    spec, mesh = placement.spec, placement.mesh
    prog = program_for(spec, forward_only)
    p, v = prog.schedule.p, prog.schedule.v
    Ls = model.cfg.n_layers // (p * v)
    m = prog.schedule.m
    param_spec = jax.tree_util.tree_map_with_path(
        lambda path, _: P("pp") if _is_layers(path) else P(), model.abstract_params)

    def body(params, batch, scale):
        d = jax.lax.axis_index("pp")
        layers = params["layers"]
        outer = {k: val for k, val in params.items() if k != "layers"}
        mod = lambda lay, out: model.module({**out, "layers": lay})          # noqa: E731
        micro = accumulate.split(batch, m)
        slots_total = batch["targets"].size
        factor = scale / slots_total

        def chunk(c):
            return jax.tree.map(lambda a: a[c * Ls:(c + 1) * Ls], layers)

        def micro_batch(j):
            mb = jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, j, keepdims=False), micro)
            return {k: constrain(val, "batch", "seq") for k, val in mb.items()}

        def embed(out, mb):
            return mod(layers, out).embed_tokens(mb["inputs"])

        def stage(lay, x, mb):
            return mod(lay, outer).blocks(x, mb.get("positions"), mb.get("segment_ids"),
                                          block_wrapper)[0]

        def head_loss(out, y, mb):
            total, n = token_loss(mod(layers, out).logits(y), mb["targets"], mb["mask"])
            return total * factor, (total, n)

        # the residual structure of a stage's vjp (the same for every stage and micro-batch)
        probe = {}

        def stage_vjp(lay, x, mb):
            y, f_vjp = jax.vjp(lambda lay, x: stage(lay, x, mb), lay, x)
            leaves, tree = jax.tree.flatten(f_vjp)
            weights = jax.tree.leaves(lay)
            where = tuple(next((i for i, w in enumerate(weights) if w is leaf), None)
                          for leaf in leaves)
            probe.update(tree=tree, where=where)
            return y, [leaf for leaf, w in zip(leaves, where) if w is None]

        mb0 = jax.eval_shape(micro_batch, 0)
        x_shape = jax.eval_shape(lambda mb: embed(outer, mb), mb0)
        res_shapes = [] if forward_only else jax.eval_shape(stage_vjp, chunk(0), x_shape, mb0)[1]
        zeros = lambda n, s: jnp.zeros((n, *s.shape), s.dtype)                # noqa: E731
        along = current(mesh, placement.rules)[1].spec(("batch", "norm_seq", "embed"))
        stream = lambda n: jax.lax.with_sharding_constraint(zeros(n, x_shape),  # noqa: E731
                                                            P(None, *along))
        buf = {"act": stream(prog.slots["act"]), "grad": stream(prog.slots["grad"]),
               "res": [zeros(prog.slots["res"], s) for s in res_shapes]}
        acc = {"layers": jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), layers),
               "outer": jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), outer),
               "loss": jnp.zeros((), jnp.float32), "tokens": jnp.zeros((), jnp.float32)}
        no_send = jnp.zeros(x_shape.shape, x_shape.dtype)

        def add(tree, g, rows=None):
            if rows is None:
                return jax.tree.map(lambda a, b: a + b.astype(jnp.float32), tree, g)
            return jax.tree.map(lambda a, b: a.at[rows].add(b.astype(jnp.float32)), tree, g)

        def rebuild_vjp(lay, kept):
            kept, weights = iter(kept), jax.tree.leaves(lay)
            leaves = [weights[w] if w is not None else next(kept) for w in probe["where"]]
            return jax.tree.unflatten(probe["tree"], leaves)

        def branch(kind, c, first, last):
            """One op, reading the buffers at its slots (j, inp, r, out), returning the values to
            write back at slots r and out (written outside: a switch returning whole buffers
            copies them), the accumulators and what to send forward and backward."""
            rows = slice(c * Ls, (c + 1) * Ls)

            def run(idx, buf, acc):
                j, inp, r, out = idx
                mb = micro_batch(j)
                res = [b[r] for b in buf["res"]]               # unchanged unless F writes them
                g_store = buf["grad"][out]
                send_f = send_b = no_send
                if kind == "F":
                    x = embed(outer, mb) if first else buf["act"][inp]
                    if forward_only:
                        y = stage(chunk(c), x, mb)
                    else:
                        y, res = stage_vjp(chunk(c), x, mb)
                    if not last:
                        return res, g_store, acc, y, send_b
                    if forward_only:
                        _, (total, n) = head_loss(outer, y, mb)
                    else:
                        (_, (total, n)), (g_out, g_y) = jax.value_and_grad(
                            head_loss, (0, 1), has_aux=True)(outer, y, mb)
                        acc = {**acc, "outer": add(acc["outer"], g_out)}
                        g_store = g_y.astype(x.dtype)
                    acc = {**acc, "loss": acc["loss"] + total, "tokens": acc["tokens"] + n}
                elif kind in ("B", "W"):
                    g_lay, g_x = rebuild_vjp(chunk(c), res)(buf["grad"][inp])
                    if kind == "W" or not split:
                        acc = {**acc, "layers": add(acc["layers"], g_lay, rows)}
                    if kind == "B" and first:
                        _, e_vjp = jax.vjp(lambda o: embed(o, mb), outer)
                        acc = {**acc, "outer": add(acc["outer"], e_vjp(g_x)[0])}
                    elif kind == "B":
                        send_b = g_x.astype(no_send.dtype)
                return res, g_store, acc, send_f, send_b
            return run

        split = prog.schedule.split_backward
        fns = [branch(*b) for b in prog.branches]
        col = {f: i for i, f in enumerate(FIELDS)}
        ring_f = [(s, (s + 1) % p) for s in range(p) if v > 1 or s < p - 1]
        ring_b = [(s, (s - 1) % p) for s in range(p) if v > 1 or s > 0]

        def receive(buf, name, got, slot):
            at = jnp.maximum(slot, 0)
            return {**buf, name: buf[name].at[at].set(jnp.where(slot >= 0, got, buf[name][at]))}

        def tick(carry, rows):
            buf, acc = carry
            row = rows[d]
            idx = tuple(jnp.maximum(row[col[f]], 0) for f in ("mb", "inp", "res", "out"))
            res, g_store, acc, send_f, send_b = jax.lax.switch(row[col["branch"]], fns, idx, buf,
                                                               acc)
            _, _, r, out = idx
            buf = {"act": buf["act"], "grad": buf["grad"].at[out].set(g_store),
                   "res": [b.at[r].set(x) for b, x in zip(buf["res"], res)]}
            buf = receive(buf, "act", jax.lax.ppermute(send_f, "pp", ring_f), row[col["recv_act"]])
            if not forward_only:
                buf = receive(buf, "grad", jax.lax.ppermute(send_b, "pp", ring_b),
                              row[col["recv_grad"]])
            return (buf, acc), None

        (buf, acc), _ = jax.lax.scan(tick, (buf, acc), jnp.asarray(prog.table))
        loss, tokens = jax.lax.psum((acc["loss"], acc["tokens"]), "pp")
        if forward_only:
            return loss, tokens
        return {**jax.lax.psum(acc["outer"], "pp"), "layers": acc["layers"]}, loss, tokens

    def manual_body(*args):
        with manual(("pp",)):      # the stage's layout: the rules less pp, on this region's mesh
            return body(*args)

    def run(params, batch, scale):
        out_specs = (P(), P()) if forward_only else (param_spec, P(), P())
        here = current(mesh, placement.rules)[0]     # a data region's mesh, inside one
        return jax.shard_map(manual_body, mesh=here,
                             in_specs=(param_spec, {k: P() for k in batch}, P()),
                             out_specs=out_specs, axis_names={"pp"}, check_vma=False)(
            params, batch, jnp.asarray(scale, jnp.float32))

    if forward_only:
        return lambda params, batch: run(params, batch, 1.0)

    def grads_fn(params, batch, scale=1.0):
        slots = batch["targets"].size
        grads, total, ntok = run(params, batch, scale)
        denom = jnp.where(ntok > 0, ntok, 1.0) / slots * scale
        grads = jax.tree.map(lambda g: g / denom, grads)
        return grads, total / jnp.where(ntok > 0, ntok, 1.0), ntok, {}
    return grads_fn
