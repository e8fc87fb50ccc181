"""The parameter table of jaxscale's LLaMA model and how a plan shards it, without building it.

`leaves(model)` lists every parameter the model creates (`models/llama.py`), with its shape, its
logical axes (the names the model annotates it with) and its *use*: `dot` for a weight contracted
in a matmul, `norm` for an RMSNorm scale (its gradient is a `reduce_sum`), `embedding` for the
token table (its gradient is a scatter-add). The use decides how XLA reduces its gradient (see
`jaxscale.strategies.dp`). `tests/test_planner.py` checks the table against the real model's
abstract parameters and logical specs, so the two cannot drift apart.

`Leaf.local_size` is a leaf's elements per device under a plan's logical->mesh rules
(`jaxscale.plan.rules`); ZeRO's split of each state part over `dp` on top of that is
`jaxscale.strategies.zero.shards`.

Which axes a weight contracts, from its logical names only (`contracted_axes`: quantisation and
pruning both need it):
- `layers` and `experts` are stacked copies, never contracted: each index is its own matrix;
- norm scales (one non-stacked axis, e.g. ("layers", "embed")) are not weights;
- output projections, whose last axis is `embed` (wo: heads, head_dim -> embed; w_down: mlp ->
  embed), contract every other non-stacked axis; all other weights contract their `embed` axis
  (wq/wk/wv, w_gate/w_up, head, the MoE router). The embedding table ("vocab", "embed") is a
  lookup (`is_lookup`): its `embed` axis is the one reduced, so it gets one scale per row.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Leaf:
    path: str
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    use: str                      # dot | norm | embedding | router

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def stacked(self) -> bool:
        return bool(self.axes) and self.axes[0] == "layers"

    def local_size(self, spec, drop: tuple[str, ...] = ()) -> float:
        """Elements per device under `spec`'s rules: each dimension divided by the degrees of
        the mesh axes its logical axis maps to (`drop`: mesh axes treated as gathered)."""
        return float(math.prod(self.local_shape(spec, drop)))

    def run_size(self, spec, drop: tuple[str, ...] = ()) -> float:
        """`local_size` of the layers a device runs, averaged over the pipeline's devices (a
        stacked leaf's stored rows include uneven stages' padding, which no layer reads): what a
        collective of every layer run moves."""
        size = self.local_size(spec, drop)
        if self.stacked and spec.deg("pp") > 1:
            return size / spec.stored_layers * spec.layers_per_device
        return size

    def local_shape(self, spec, drop: tuple[str, ...] = ()) -> tuple[int, ...]:
        """The device's shard of this leaf under `spec`'s rules (`drop`: mesh axes treated as
        gathered); a mesh axis already used by an earlier dimension does not split again."""
        table, used, out = spec.rules.table, set(), []
        for dim, ax in zip(self.shape, self.axes):
            axes = [m for m in table.get(ax, ()) if m not in used]
            used.update(axes)
            if ax == "layers" and "pp" in axes:      # the stages' blocks, padding included
                out.append(spec.stored_layers)
                continue
            out.append(math.ceil(dim / math.prod(spec.deg(m) for m in axes if m not in drop)))
        return tuple(out)


def leaves(model) -> list[Leaf]:
    """Every parameter of `jaxscale.models.llama.Llama(model)` (stacked over `layers` when
    scanned)."""
    d, f, hd, H, K, V = (model.dim, model.ffn_dim, model.hd, model.n_heads, model.n_kv_heads,
                         model.padded_vocab)
    attn = [
        ("attn_norm/scale", (d,), ("embed",), "norm"),
        ("attn/wq", (d, H, hd), ("embed", "heads", "head_dim"), "dot"),
        ("attn/wk", (d, K, hd), ("embed", "kv_heads", "head_dim"), "dot"),
        ("attn/wv", (d, K, hd), ("embed", "kv_heads", "head_dim"), "dot"),
        ("attn/wo", (H, hd, d), ("heads", "head_dim", "embed"), "dot"),
        ("mlp_norm/scale", (d,), ("embed",), "norm"),
    ]
    dense = [("mlp/w_gate", (d, f), ("embed", "mlp"), "dot"),
             ("mlp/w_up", (d, f), ("embed", "mlp"), "dot"),
             ("mlp/w_down", (f, d), ("mlp", "embed"), "dot")]
    E = getattr(model, "moe_experts", 0)
    fe = model.expert_ffn if E else f
    fs = getattr(model, "moe_shared_experts", 0) * fe
    experts = [("mlp/router", (d, E), ("embed", None), "router"),
               ("mlp/w_gate", (E, d, fe), ("experts", "embed", "mlp"), "dot"),
               ("mlp/w_up", (E, d, fe), ("experts", "embed", "mlp"), "dot"),
               ("mlp/w_down", (E, fe, d), ("experts", "mlp", "embed"), "dot")]
    if E and getattr(model, "moe_bias_rate", 0):
        experts.append(("mlp/router_bias", (E,), (None,), "router"))
    if fs:
        experts += [("mlp/shared_gate", (d, fs), ("embed", "mlp"), "dot"),
                    ("mlp/shared_up", (d, fs), ("embed", "mlp"), "dot"),
                    ("mlp/shared_down", (fs, d), ("mlp", "embed"), "dot")]

    def layer(i):            # a mixture of experts in every moe_every-th layer (models/moe.py)
        return attn + (experts if E and model.is_moe_layer(i) else dense)
    out = [Leaf("embed", (V, d), ("vocab", "embed"), "embedding")]
    if model.scan_layers:        # identical layers (ModelConfig.relations: moe_every = 1)
        out += [Leaf(f"layers/{p}", (model.n_layers,) + s, ("layers",) + a, u)
                for p, s, a, u in layer(0)]
    else:
        out += [Leaf(f"layers/{i}/{p}", s, a, u)
                for i in range(model.n_layers) for p, s, a, u in layer(i)]
    out.append(Leaf("norm/scale", (d,), ("embed",), "norm"))
    if not model.tie_embeddings:
        out.append(Leaf("head", (d, V), ("embed", "vocab"), "dot"))
    return out


def count(model) -> int:
    """Total parameters as stored (equals `ModelConfig.param_count()` unless the vocabulary is
    padded: these count the padding rows too)."""
    return sum(leaf.size for leaf in leaves(model))


def active_count(model) -> int:
    """Parameters a token passes through (MoE: top_k of the experts)."""
    if not getattr(model, "moe_experts", 0):
        return count(model)
    expert = 3 * model.dim * model.expert_ffn * model.n_moe_layers
    bias = model.moe_experts * model.n_moe_layers if model.moe_bias_rate else 0
    return count(model) - (model.moe_experts - model.moe_top_k) * expert - bias


#: logical axes of stacked copies (each index its own matrix), never contracted
STACKED = ("layers", "experts")


def contracted_axes(names: tuple) -> tuple[int, ...] | None:
    """Positions of the axes a weight with these logical names contracts (its input), or None
    for a leaf that is not a weight (a norm scale, a bias)."""
    own = [i for i, n in enumerate(names) if n not in STACKED]
    if len(own) < 2:
        return None
    if names[own[-1]] == "embed" and names[own[0]] != "vocab":     # output projection
        return tuple(own[:-1])
    emb = tuple(i for i in own if names[i] == "embed")
    if not emb:
        raise ValueError(f"weight with logical axes {names} has no 'embed' axis: cannot tell "
                         f"its contracted (input) axis")
    return emb


def is_lookup(names: tuple) -> bool:
    """An embedding table ("vocab", "embed"): read by row, never multiplied."""
    own = [n for n in names if n not in STACKED]
    return own[:1] == ["vocab"] and own[-1:] == ["embed"]


def outer_runs(spec, leaf=None) -> float:
    """How often per step, averaged over the devices, the embedding or the head runs (and their
    collectives with it): once per micro-batch (m), or with pipelining only on the first or last
    stage, m / p; a tied embedding's gradient (`leaf`) comes from both stages, 2 m / p."""
    k, p = max(1, spec.accumulate), spec.deg("pp")
    if p == 1:
        return k
    tied = leaf is not None and leaf.use == "embedding" and spec.model.tie_embeddings
    return k / p * (2 if tied else 1)


def outer_gathers(spec, leaf=None) -> float:
    """How often per step, averaged over the devices, a weight outside the layers (embedding,
    final norm, head) is gathered for its forward: once, the gather hoisted out of the
    micro-batch loop; with pipelining in its stage's forward op, each time it runs
    (`outer_runs`)."""
    return outer_runs(spec, leaf) if spec.deg("pp") > 1 else 1
