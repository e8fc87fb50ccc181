"""The host-driven offload step (`plan.offload_tier=nvme`, `plan.offload_update=host`): a jitted
forward and backward, then the optimizer update driven from the host, one piece of the state
(a layer of every stacked leaf, or one unstacked leaf) at a time, over a store of the offloaded
state (files under `plan.offload_dir`, or host RAM; `store.py`) with one piece of read-ahead.

The update of a piece runs on the device (`offload_update=device`: the jitted piece update of
`streaming.py`'s loop, so the nvme tier computes what the host tier computes) or on the host CPU
(`offload_update=host`: numpy AdamW, `host_adam.py`); with `offload_delay` the host's update runs
on a thread while the next step's forward and backward run on the previous parameters. Adds no
collective; costs and savings: `offload/tiers.py`. Every byte it moves is counted
(`Step.counted`) against the formulas there.

The train state between steps is the usual `TrainState` with the stored parts `None`;
`full_state` reads them back into a whole state (the Orbax checkpoint's, identical to the host
tier's) and `adopt` writes a whole state (a fresh one, a restored one) into a fresh store.
"""
from __future__ import annotations

import dataclasses
import threading

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxscale.strategies.common import keep_if_finite
from jaxscale.strategies.offload import device_half, host_adam
from jaxscale.strategies.offload.store import Leaf, RamStore, Store


class Step:
    """(thin state, batch) -> (thin state, metrics), plus `adopt`, `full_state`, `lower`."""
    host_driven = True

    def __init__(self, ctx, spec, optim):
        self.ctx, self.spec, self.optim = ctx, spec, optim
        self.on_host = spec.offload_update == "host"
        self.delay = bool(spec.offload_delay)
        self.nvme = spec.offload_tier == "nvme"
        lay, host_sh = ctx.lay, ctx.host_sh
        self.mixed = lay.master
        self.thin_sh = dataclasses.replace(host_sh, opt_state=None, master=None)
        # the stored leaves: every leaf of the optimizer state, then the master's
        abstract = ctx.model.abstract_params
        opt = jax.eval_shape(ctx.optimizer.init, abstract)
        opt_index = optax.tree_map_params(ctx.optimizer, lambda _, j: j, opt, ctx.param_index,
                                          transform_non_params=lambda _: -1)
        paths, self.opt_def = jax.tree_util.tree_flatten_with_path(opt)
        self.n_opt = len(paths)
        idx = jax.tree.leaves(opt_index)
        mleaves = jax.tree.leaves(abstract) if self.mixed else []
        shapes = [x for _, x in paths] + mleaves
        self.index = idx + list(range(len(mleaves)))
        self.leaves = [Leaf(tuple(x.shape), np.dtype(x.dtype), j in ctx.stacked)
                       for x, j in zip(shapes, self.index)]
        names = [jax.tree_util.keystr(p) for p, _ in paths]
        self.mu = {j: k for k, (n, j) in enumerate(zip(names, idx)) if ".mu" in n}
        self.nu = {j: k for k, (n, j) in enumerate(zip(names, idx)) if ".nu" in n}
        counts = [k for k, j in enumerate(idx) if j == -1]
        adam_prefix = next((names[k].split(".mu")[0] for k in self.mu.values()), None)
        self.adam_count = next((k for k in counts if names[k] == f"{adam_prefix}.count"), None)
        self.counts = counts
        self.decay = [not any(getattr(k, "key", None) == "scale" for k in path)
                      for path, _ in jax.tree_util.tree_flatten_with_path(abstract)[0]]
        self.n_params = len(self.decay)
        # a mixture's routing biases step by -rate x sign(signal) (train.state._bias_steps)
        self.bias = [getattr(path[-1], "key", None) == "router_bias"
                     for path, _ in jax.tree_util.tree_flatten_with_path(abstract)[0]]
        L = {leaf.shape[0] for leaf in self.leaves if leaf.stacked}
        self.pieces = [("layer", i) for i in range(L.pop() if L else 0)] + [
            ("leaf", j) for j in range(self.n_params) if j not in ctx.stacked]
        dev_leaves = jax.tree.leaves(ctx.device_sh.opt_state) + (
            jax.tree.leaves(ctx.device_sh.master) if self.mixed else [])
        self.piece_sh = [self._piece_sharding(sh, leaf.stacked)
                         for sh, leaf in zip(dev_leaves, self.leaves)]
        self.param_sh = jax.tree.leaves(host_sh.params)
        self.store = None
        self.pending = None                         # the delayed update in flight
        self.link = {"in": 0, "out": 0}
        self._grads = device_half.grads_step(ctx, self.thin_sh)
        self._piece = jax.jit(self._piece_fn)
        self._take = jax.jit(lambda xs, i: [x[i] for x in xs])
        self._set = jax.jit(lambda big, v, i: jax.lax.dynamic_update_index_in_dim(big, v, i, 0),
                            donate_argnums=0)

    @staticmethod
    def _piece_sharding(sh, stacked):
        if not stacked:
            return sh
        return NamedSharding(sh.mesh, P(*tuple(sh.spec)[1:]))

    # ------------------------------------------------------------------ the store
    def adopt(self, state):
        """A whole train state -> the thin one, its offloaded parts written into a new store."""
        self.finish()
        if self.store is not None:
            self.store.close()
        self.store = (Store(self.spec.offload_dir, self.leaves) if self.nvme
                      else RamStore(self.leaves))
        stored = jax.tree.leaves(state.opt_state) + (jax.tree.leaves(state.master)
                                                     if self.mixed else [])
        for k in range(len(stored)):                # one leaf in host RAM at a time
            x = np.array(jax.device_get(stored[k]))
            stored[k] = None
            self.store.write(k, x)
            del x
        self.store.bytes_written = 0
        return dataclasses.replace(state, opt_state=None, master=None)

    def full_state(self, state):
        """The whole train state (offloaded parts where the host tier keeps them), read back
        from the store: what a checkpoint saves. Waits for a delayed update in flight."""
        state = self.finish(state)
        r0 = self.store.bytes_read
        sh = jax.tree.leaves(self.ctx.host_sh.opt_state) + (
            jax.tree.leaves(self.ctx.host_sh.master) if self.mixed else [])
        # a copy: on CPU `device_put` may alias a numpy buffer, and the RAM store updates its
        # arrays in place: the state returned (a checkpoint's) must not change with later steps
        vals = [jax.device_put(np.array(self.store.read(k)), s) for k, s in enumerate(sh)]
        self.store.bytes_read = r0                  # not the step's traffic
        opt = jax.tree.unflatten(self.opt_def, vals[:self.n_opt])
        master = (jax.tree.unflatten(jax.tree.structure(self.ctx.model.abstract_params),
                                     vals[self.n_opt:]) if self.mixed else None)
        return dataclasses.replace(state, opt_state=opt, master=master)

    def counted(self) -> dict:
        return {"disk_read": self.store.bytes_read if self.nvme else 0,
                "disk_written": self.store.bytes_written if self.nvme else 0,
                "link_in": self.link["in"], "link_out": self.link["out"]}

    def reset_counts(self):
        self.store.bytes_read = self.store.bytes_written = 0
        self.link = {"in": 0, "out": 0}

    # ------------------------------------------------------------------ the jitted parts
    def _piece_fn(self, grads, norm, finite, opt_state, target):
        """`streaming.streamed`'s piece: the update of one piece, kept if the step is finite."""
        ctx = self.ctx
        old = (opt_state, target)
        new_opt, new_target = keep_if_finite(finite, ctx.apply_update((grads, norm), old), old)
        return ctx.policy.working(new_target), new_opt, new_target

    # ------------------------------------------------------------------ the step
    def __call__(self, state, batch):
        new, grads, norm, finite, metrics = self._grads(state, batch)
        if self.pending is not None:                # the delayed update of the last step
            new = dataclasses.replace(new, params=self._join())
        if self.delay:
            count = state.step
            self.pending = [None, None]

            def work():
                try:
                    self.pending[1] = self._update(grads, norm, finite, new.params)
                except BaseException as e:    # noqa: BLE001 - raised in the caller's thread
                    self.pending[1] = e
            self.pending[0] = threading.Thread(target=work, name=f"offload-update-{count}")
            self.pending[0].start()
            return new, metrics
        return dataclasses.replace(new, params=self._update(grads, norm, finite, new.params)), \
            metrics

    def _join(self):
        thread, result = self.pending
        thread.join()
        result = self.pending[1]
        self.pending = None
        if isinstance(result, BaseException):
            raise result
        return result

    def finish(self, state=None):
        """Wait for a delayed update in flight; the state with its parameters installed."""
        if self.pending is None:
            return state
        params = self._join()
        return None if state is None else dataclasses.replace(state, params=params)

    def _update(self, grads, norm, finite, params):
        """The update of every piece; the new working parameters (the old if not finite)."""
        if not bool(jax.device_get(finite)):
            return params
        store = self.store
        counts = {k: store.read(k) for k in self.counts}
        g_leaves = jax.tree.leaves(grads)
        p_leaves = list(jax.tree.leaves(params))
        stacked = sorted(self.ctx.stacked)
        if self.on_host:
            self._scalars = host_adam.Scalars.of(self.optim, self.ctx.learning_rate,
                                                 int(counts[self.adam_count]), norm)
        new_counts, host_params = {}, {}

        def keys(piece):
            kind, n = piece
            if kind == "layer":
                return [(k, n) for k, j in enumerate(self.index) if j in self.ctx.stacked
                        and k not in self.counts]
            return [(k, None) for k, j in enumerate(self.index) if j == n and k not in self.counts]

        def update(piece, old):
            kind, n = piece
            js = stacked if kind == "layer" else [n]
            if kind == "layer":
                g = dict(zip(js, self._take([g_leaves[j] for j in js], n)))
                cur = dict(zip(js, self._take([p_leaves[j] for j in js], n))) \
                    if not self.mixed else {}
            else:
                g, cur = {n: g_leaves[n]}, ({n: p_leaves[n]} if not self.mixed else {})
            if self.on_host:
                new, working = self._host_piece(js, g, cur, old)
            else:
                new, working = self._device_piece(js, g, cur, old, counts, norm, finite,
                                                  new_counts)
            for j, w in working.items():
                if self.on_host and kind == "layer":      # to the device whole, at the end
                    host_params.setdefault(j, np.empty(p_leaves[j].shape, w.dtype))[n] = w
                elif self.on_host:
                    host_params[j] = w
                else:
                    p_leaves[j] = self._set(p_leaves[j], w, n) if kind == "layer" else w
            return new

        store.stream(self.pieces, keys, update)
        for k, v in counts.items():
            store.write(k, new_counts.get(k, v + 1))
        for j, w in host_params.items():
            p_leaves[j] = self._to_device(w, self.param_sh[j])
        return jax.tree.unflatten(jax.tree.structure(params), p_leaves)

    def _to_device(self, x, sh):
        out = jax.device_put(x, sh)
        self.link["out"] += sum(s.data.nbytes for s in out.addressable_shards)
        return out

    def _to_host(self, x):
        out = np.asarray(jax.device_get(x))
        self.link["in"] += out.nbytes
        return out

    def _device_piece(self, js, g, cur, old, counts, norm, finite, new_counts):
        n_opt, n_par = self.n_opt, self.n_params
        opt = [None] * n_opt
        for k in range(n_opt):
            if k in counts:
                opt[k] = counts[k]
            elif k in old:
                opt[k] = self._to_device(old[k], self.piece_sh[k])
        grads = [g.get(j) for j in range(n_par)]
        if self.mixed:
            target = [self._to_device(old[n_opt + j], self.piece_sh[n_opt + j])
                      if n_opt + j in old else None for j in range(n_par)]
        else:
            target = [cur.get(j) for j in range(n_par)]
        pdef = jax.tree.structure(self.ctx.model.abstract_params)
        working, new_opt, new_target = (jax.tree.leaves(t, is_leaf=lambda x: x is None) for t in
                                        self._piece(jax.tree.unflatten(pdef, grads), norm, finite,
                                                    jax.tree.unflatten(self.opt_def, opt),
                                                    jax.tree.unflatten(pdef, target)))
        new = {k: self._to_host(new_opt[k]) for k in old if k < n_opt}
        if self.mixed:
            new.update({n_opt + j: self._to_host(new_target[j]) for j in js})
        for k in counts:
            new_counts[k] = np.asarray(new_opt[k])
        return new, {j: working[j] for j in js}

    def _host_piece(self, js, g, cur, old):
        """numpy AdamW of one piece: the new stored values and the new working parameters."""
        n_opt, s = self.n_opt, self._scalars
        new, working = {}, {}
        for j in js:
            grad = self._to_host(g[j])
            target = old[n_opt + j] if self.mixed else self._to_host(cur[j])
            mu, nu, t = host_adam.adamw(self.optim, s, grad, old[self.mu[j]], old[self.nu[j]],
                                        target, self.decay[j])
            if self.bias[j]:
                t = host_adam.sign_step(self.spec.model.moe_bias_rate, grad, target)
            new[self.mu[j]], new[self.nu[j]] = mu, nu
            if self.mixed:
                new[n_opt + j] = t
            working[j] = t.astype(self.ctx.policy.param_dtype) if self.mixed else t
        return new, working

    def lower(self, state, batch):
        """The forward and backward program (the device side of the step)."""
        state = dataclasses.replace(state, opt_state=None, master=None)
        with jax.set_mesh(self.ctx.placement.mesh):
            return self._grads.lower(state, batch)
