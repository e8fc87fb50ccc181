"""The pipeline engine: a schedule from `jaxscale.strategies.pp.schedules` run over the `pp` mesh axis.

`compile_schedule` turns a schedule (per device, an ordered list of F / B / W ops) into a table of
ticks: the schedule simulated with every op costing one tick, so each device runs at most one op
per tick and an op's inputs were sent at the end of an earlier tick. `make_grads_fn` runs that
table inside `jax.shard_map`, manual over `pp` only (dp, fsdp and tp inside a stage stay GSPMD's):

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
  output gradient (so W repeats the in-stage backward chain: JAX's vjp does not split per matmul);
- slots are assigned when the table is built (a register allocation per device), so each buffer
  holds the peak number of values alive at once: GPipe's residual buffer has m slots, 1F1B's p.

Stage s (of S = p v) lives on device s mod p as its chunk s // p. Device d's local share of the
stacked layers is chunk-major: with interleaving (v > 1) the stored layer order is a permutation
of the model's (`strategies.pp.layer_order`), which `reorder` undoes or redoes, e.g. when a
checkpoint is restored under another plan.
Weights of the embedding, final norm and head are replicated over pp; their gradients are summed
over pp (one all-reduce) at the end, with the loss.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from jaxscale.strategies.pp import schedules as ps


def reorder(tree, saved: list[int] | None, wanted: list[int] | None):
    """`tree` (params, a train state: any tree whose stacked layers sit under a "layers" key) with
    its layers moved from the stored order `saved` to `wanted` (None: the model's order; see
    `strategies.pp.layer_order`). Traceable; eagerly, each array keeps its sharding."""
    import jax
    L = next((leaf.shape[0] for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
              if _is_layers(path)), None)
    if L is None or (saved or list(range(L))) == (wanted or list(range(L))):
        return tree
    row_of = {layer: r for r, layer in enumerate(saved or range(L))}
    take = np.array([row_of[layer] for layer in (wanted or range(L))])

    def move(a):
        if isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer):
            return jax.jit(lambda a: a[take], out_shardings=a.sharding)(a)
        return a[take]
    return jax.tree_util.tree_map_with_path(lambda path, a: move(a) if _is_layers(path) else a,
                                            tree)


def _is_layers(path) -> bool:
    return any(getattr(k, "key", None) == "layers" for k in path)


# ----------------------------------------------------------------------------- the tick table
IDLE = 0
FIELDS = ("branch", "mb", "inp", "res", "out", "recv_act", "recv_grad")


@dataclass(frozen=True)
class Program:
    """A schedule as the engine runs it: per tick and device the fields of `FIELDS` (branch 0 =
    idle, slots -1 = none), the senders of each tick, and the slot counts of each buffer."""
    schedule: ps.Schedule
    branches: tuple[tuple[str, int, bool, bool], ...]      # (kind, chunk, first, last); [0] idle
    table: np.ndarray                                      # [ticks, p, len(FIELDS)] int32
    send_fwd: tuple[tuple[int, ...], ...]                  # per tick, devices sending forward
    send_bwd: tuple[tuple[int, ...], ...]
    slots: dict                                            # {"act", "grad", "res"} -> count

    @property
    def ticks(self) -> int:
        return len(self.table)

    @property
    def forward_only(self) -> bool:
        return all(b[0] in ("idle", "F") for b in self.branches)

    @property
    def permutes(self) -> int:
        """Collective-permutes per step: one forward (and one backward) per tick."""
        return self.ticks * (1 if self.forward_only else 2)

    @property
    def useful_sends(self) -> int:
        """Ticks in which some device has an activation (or gradient) to send: the permutes an
        unrolled engine would issue (the tick loop sends zeros in the others)."""
        return sum(map(bool, self.send_fwd)) + sum(map(bool, self.send_bwd))

    def branch_share(self) -> list[float]:
        """Per branch, the fraction of (tick, device) slots it fills: how often the switch runs it,
        averaged over the devices (`hlo.Module`'s `branch_share`)."""
        b = self.table[..., 0]
        return [float(np.mean(b == i)) for i in range(len(self.branches))]


class _Pool:
    def __init__(self):
        self.free, self.size = [], 0

    def take(self) -> int:
        if self.free:
            return self.free.pop()
        self.size += 1
        return self.size - 1

    def give(self, slot: int) -> None:
        self.free.append(slot)


def compile_schedule(schedule: ps.Schedule, forward_only: bool = False) -> Program:
    """Ticks, branches and slots of `schedule` (forward_only: its F ops, for evaluation)."""
    p, v, S = schedule.p, schedule.v, schedule.stages
    if forward_only:
        schedule = ps.Schedule(schedule.name, p, schedule.m, v, tuple(
            tuple(op for op in prog if op.kind == "F") for prog in schedule.programs))
    split = schedule.split_backward
    res = ps.simulate(schedule, v, v, v if split else None)       # every op one unit
    times = sorted(set(res.start.values()))
    at: list[dict[int, ps.Op]] = [{} for _ in times]
    for op, t in res.start.items():
        at[times.index(t)][op.device] = op
    branches: list = [("idle", 0, False, False)]
    table = np.full((len(times), p, len(FIELDS)), -1, np.int32)
    table[..., 0] = IDLE
    pools = [{k: _Pool() for k in ("act", "grad", "res")} for _ in range(p)]
    held: dict[tuple, int] = {}        # (buffer, stage, micro-batch) -> slot, on the stage's device
    send_f, send_b = [], []
    for t, ops in enumerate(at):
        sf, sb = [], []
        for d, op in sorted(ops.items()):
            s, j, pool = op.stage, op.micro_batch, pools[d]
            key = (op.kind, s // p, s == 0, s == S - 1)
            if key not in branches:
                branches.append(key)
            row = dict(branch=branches.index(key), mb=j)
            if op.kind == "F":
                if s > 0:
                    row["inp"] = held.pop(("act", s, j))
                    pool["act"].give(row["inp"])
                if not forward_only:
                    row["res"] = held[("res", s, j)] = pool["res"].take()
                if s == S - 1 and not forward_only:
                    row["out"] = held[("grad", s, j)] = pool["grad"].take()
                elif s < S - 1:
                    sf.append(d)
            else:
                row["res"], row["inp"] = held[("res", s, j)], held[("grad", s, j)]
                if op.kind == "W" or not split:
                    pool["res"].give(held.pop(("res", s, j)))
                    pool["grad"].give(held.pop(("grad", s, j)))
                if op.kind == "B" and s > 0:
                    sb.append(d)
            for k, val in row.items():
                table[t, d, FIELDS.index(k)] = val
        for d in sf:                   # received at the end of the tick, after every op ran
            op, r = ops[d], (d + 1) % p
            table[t, r, FIELDS.index("recv_act")] = held[("act", op.stage + 1, op.micro_batch)] \
                = pools[r]["act"].take()
        for d in sb:
            op, r = ops[d], (d - 1) % p
            table[t, r, FIELDS.index("recv_grad")] = held[("grad", op.stage - 1, op.micro_batch)] \
                = pools[r]["grad"].take()
        send_f.append(tuple(sf))
        send_b.append(tuple(sb))
    assert not held, f"values never consumed: {sorted(held)[:4]}"
    slots = {k: max(1, max(pl[k].size for pl in pools)) for k in ("act", "grad", "res")}
    return Program(schedule, tuple(branches), table, tuple(send_f), tuple(send_b), slots)


def program_for(spec, forward_only: bool = False) -> Program:
    """The plan's schedule as the engine runs it (cached: the planner asks often)."""
    from jaxscale.strategies import pp
    return _program(spec.schedule, spec.deg("pp"), max(1, spec.accumulate), pp.virtual(spec),
                    forward_only)


@functools.lru_cache(maxsize=256)
def _program(name: str, p: int, m: int, v: int, forward_only: bool) -> Program:
    return compile_schedule(ps.make(name, p, m, v), forward_only)


# ----------------------------------------------------------------------------- the engine
def _token_loss(logits_BTV, targets_BT, mask_BT):
    """`step.token_loss` with the label's logit picked by a masked sum, not a gather: XLA's SPMD
    partitioner fails on that gather inside a shard_map manual over pp when the batch and the
    vocabulary are sharded over two other axes (dp or fsdp, and tp)."""
    import jax
    import jax.numpy as jnp
    logits = logits_BTV.astype(jnp.float32)
    hit = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 2) == targets_BT[..., None]
    ce = jax.nn.logsumexp(logits, axis=-1) - jnp.sum(jnp.where(hit, logits, 0.0), axis=-1)
    mask = mask_BT.astype(jnp.float32)
    return jnp.sum(ce * mask), jnp.sum(mask)


def make_grads_fn(model, placement, block_wrapper=None, forward_only: bool = False):
    """(params, batch, scale) -> (token-mean gradients in fp32, loss, tokens, {}) of `step.
    make_grads_fn`'s contract, computed by the plan's pipeline schedule; `forward_only`:
    (params, batch) -> (sum of token losses, tokens), for evaluation."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from jaxscale.axes import constrain
    from jaxscale.strategies import accumulate

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
            total, n = _token_loss(mod(layers, out).logits(y), mb["targets"], mb["mask"])
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
        along = placement.rules.spec(("batch", "norm_seq", "embed"))     # on the shard_map's mesh
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

    def run(params, batch, scale):
        out_specs = (P(), P()) if forward_only else (param_spec, P(), P())
        return jax.shard_map(body, mesh=mesh, in_specs=(param_spec, {k: P() for k in batch}, P()),
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
