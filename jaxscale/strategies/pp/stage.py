"""One pipeline stage's work, as the engine's branches run it: forward, backward, weight pass.

A stage is the model's layer loop over its block of stored rows (`stages.py`), with per-layer
inputs beside the weights: fp8 QAT's scales (a probe: their cotangent is the amaxes the matmuls
saw) and, for a split backward, the taps of `hooks.projection`. Its function returns the stage
output and a mixture of experts' router term (the load-balancing and z losses of its MoE layers,
each weighted and averaged over all the model's MoE layers, so that its cotangent weighs it into
the loss as the unpipelined step does), and as statistics the router losses and the dropped
assignments summed over its layers.

- F: `jax.vjp` of the stage at the micro-batch's input; the residuals (what the remat policy
  keeps) go to a slot until the backward, except the stage's own weights, taken again from the
  weights when B runs.
- B: the residuals and the output gradient give the input gradient (sent back), the weight
  gradients of what B differentiates, and the probe's cotangent. Unsplit, B differentiates every
  weight of the stage. Split (ZB-H1, ZB-V), the weights the matmul sites read (`WEIGHT_OF`) are
  constants to B, which differentiates the taps instead: their cotangents, each matmul's input
  and output gradient, go to a tape slot. JAX then computes no weight gradient in B, only the
  input-gradient chain (norm scales and a router, read outside the matmul sites, stay B's).
- W: per layer, each matmul's own backward for its weight from the tape (`weight_grad`): the
  weight-gradient matmuls only, no second pass through the chain, so a split schedule's FLOPs
  equal 1F1B's.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxscale.hooks.projection import (
    SCALES,
    TAPS,
    layer_inputs,
    recording,
    weight_grad,
)
from jaxscale.models.llama import WEIGHT_OF


def _get(tree, path):
    for k in path:
        tree = tree[k]
    return tree


def _set(tree, path, value):
    if not path:
        return value
    return {**tree, path[0]: _set(tree[path[0]], path[1:], value)}


class Stage:
    """The stage function and its three ops for one model, plan and micro-batch count."""

    def __init__(self, model, outer, block_wrapper, split: bool, reg_scale):
        self.model, self.outer, self.wrap, self.split = model, outer, block_wrapper, split
        cfg = model.cfg
        self.moe = cfg.moe_experts > 0
        self.reg_scale = reg_scale        # the router term's cotangent (reg tokens x factor)
        self.n_moe = max(1, cfg.n_moe_layers)
        self.tape_sites = None            # site -> (input key, einsum, names), from `trace`

    # ------------------------------------------------------------------ the stage function
    def run(self, lay, x, mb, scales=None, taps=None):
        """((stage output, router term), statistics [aux, z, dropped, routed] summed)."""
        mod = self.model.module({**self.outer, "layers": lay})
        inputs = {}
        if scales is not None:
            inputs[SCALES] = scales
        if taps is not None:
            inputs[TAPS] = taps
        with _inputs(inputs):
            y, stats = mod.blocks(x, mb.get("positions"), mb.get("segment_ids"), self.wrap)
        if not (self.moe and stats):
            return (y, jnp.zeros((), jnp.float32)), jnp.zeros((4,), jnp.float32)
        st = jax.tree.map(lambda *a: jnp.concatenate(a), *stats)
        cfg = self.model.cfg
        reg = (cfg.moe_aux_weight * jnp.sum(st["aux_loss"]) +
               cfg.moe_z_weight * jnp.sum(st["z_loss"])) / self.n_moe
        return (y, reg), jnp.stack([jnp.sum(st[k]) for k in ("aux_loss", "z_loss", "dropped",
                                                              "routed")]).astype(jnp.float32)

    # ------------------------------------------------------------------ split bookkeeping
    def trace(self, lay, x, mb):
        """Record the stage's weight matmuls (sites outside a mixture's experts) once."""
        if self.tape_sites is None:
            with recording() as book:
                jax.eval_shape(lambda lay, x, mb: self.run(lay, x, mb), lay, x, mb)
            self.tape_sites = {s: rec[:3] for s, rec in book.items() if s in WEIGHT_OF}
            self._shapes = book
        return self.tape_sites

    def zero_taps(self, n: int):
        """The taps of n layers: zeros shaped like each tapped matmul's input and output."""
        x, y = {}, {}
        for site, (key, _, _) in self.tape_sites.items():
            xs, ys = self._shapes[site][3], self._shapes[site][4]
            x.setdefault(key, jnp.zeros((n, *xs[0]), xs[1]))
            y[site] = jnp.zeros((n, *ys[0]), ys[1])
        return {"x": x, "y": y}

    def split_weights(self, lay):
        """(the weights B differentiates, the matmul sites' weights: constants to B)."""
        if not self.split:
            return lay, None
        const = {}
        for site in self.tape_sites:
            path = WEIGHT_OF[site]
            const[site] = _get(lay, path)
            lay = _set(lay, path, None)
        return lay, const

    @staticmethod
    def join(lay, const):
        if const is None:
            return lay
        for site, w in const.items():
            lay = _set(lay, WEIGHT_OF[site], w)
        return lay

    # ------------------------------------------------------------------ the ops
    def forward(self, lay, x, mb, scales=None):
        """F: ((y, router term), statistics, vjp), the vjp over {x, w, scales, taps}."""
        n = jax.tree.leaves(lay)[0].shape[0]
        diff, const = self.split_weights(lay)
        args = {"x": x, "w": diff, "scales": scales,
                "taps": self.zero_taps(n) if self.split else None}

        def f(a):
            return self.run(self.join(a["w"], const), a["x"], mb, a["scales"], a["taps"])
        out, vjp, stats = jax.vjp(f, args, has_aux=True)
        return out, stats, vjp

    def backward(self, vjp, g_y):
        """B: the cotangents {x, w, scales, taps} of the output gradient (and the router term's
        weight)."""
        return vjp((g_y, jnp.asarray(self.reg_scale, jnp.float32)))[0]

    def weights(self, lay, tape, scales=None):
        """W: the gradients of the matmul sites' weights from the tape, layer by layer (the
        stage's scales read: B recorded what the matmuls saw, `weight_grad`)."""
        sites = self.tape_sites
        const = {site: _get(lay, WEIGHT_OF[site]) for site in sites}

        def layer(_, xs):
            w, tp, sc = xs
            return None, {site: weight_grad(eq, tp["x"][key], w[site], tp["y"][site], site,
                                            names, sc)
                          for site, (key, eq, names) in sites.items()}
        _, grads = jax.lax.scan(layer, None, (const, tape, scales))
        tree: dict = {}
        for site, g in grads.items():
            part, name = WEIGHT_OF[site]
            tree.setdefault(part, {})[name] = g
        return tree


class _inputs:
    """`layer_inputs` for each named tree of a dict."""

    def __init__(self, trees: dict):
        self.trees, self.stack = trees, []

    def __enter__(self):
        for name, tree in self.trees.items():
            cm = layer_inputs(tree, name)
            cm.__enter__()
            self.stack.append(cm)

    def __exit__(self, *exc):
        while self.stack:
            self.stack.pop().__exit__(*exc)
