"""The parameter table of jaxscale's LLaMA model and how a plan shards it, without building it.

`leaves(model)` lists every parameter the model creates (`models/llama.py`), with its shape, its
logical axes (the names the model annotates it with) and its *use*: `dot` for a weight contracted
in a matmul, `norm` for an RMSNorm scale (its gradient is a `reduce_sum`), `embedding` for the
token table (its gradient is a scatter-add). The use decides how XLA reduces its gradient (see
`jaxscale.strategies.dp`). `tests/test_planner.py` checks the table against the real model's abstract
parameters and logical specs, so the two cannot drift apart.

Sharding follows the plan's logical->mesh rules (`jaxscale.plan.rules`, composed from the
strategies); ZeRO (`jaxscale.strategies.zero.shard_factor`) shards the state over `dp` on top of
that, stage by stage. The `fsdp` axis always shards all three parts (it *is* ZeRO-3 over its
devices).
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
        table = spec.rules.table
        n = 1.0
        for dim, ax in zip(self.shape, self.axes):
            split = math.prod(spec.deg(m) for m in table.get(ax, ()) if m not in drop)
            n *= math.ceil(dim / split)
        return n


def leaves(model) -> list[Leaf]:
    """Every parameter of `jaxscale.models.llama.Llama(model)` (stacked over `layers` when scanned)."""
    d, f, hd, H, K, V = (model.dim, model.ffn_dim, model.hd, model.n_heads, model.n_kv_heads,
                         model.vocab_size)
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
    experts = [("mlp/router", (d, E), ("embed", None), "router"),
               ("mlp/w_gate", (E, d, f), ("experts", "embed", "mlp"), "dot"),
               ("mlp/w_up", (E, d, f), ("experts", "embed", "mlp"), "dot"),
               ("mlp/w_down", (E, f, d), ("experts", "mlp", "embed"), "dot")]

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
    """Total parameters (equals `ModelConfig.param_count()`)."""
    return sum(leaf.size for leaf in leaves(model))


def active_count(model) -> int:
    """Parameters a token passes through (MoE: top_k of the experts)."""
    if not getattr(model, "moe_experts", 0):
        return count(model)
    expert = 3 * model.dim * model.ffn_dim * model.n_moe_layers
    return count(model) - (model.moe_experts - model.moe_top_k) * expert


@dataclass(frozen=True)
class Shards:
    """Per-device element counts of the model state under a plan."""
    params: float                 # stored parameters (after fsdp/tp/pp/ep and ZeRO-3 over dp)
    grads: float                  # gradients after reduction (ZeRO-2/3: also over dp)
    optimizer: float              # elements of one optimizer moment (ZeRO-1+: also over dp)
    gathered_layer: float         # one layer's parameters once gathered over fsdp (and dp, ZeRO-3)
    total: int


def shards(spec) -> Shards:
    """Per-device elements of each part of the model state under `spec` (its rules, and ZeRO's
    shard factor over dp per part)."""
    from jaxscale.strategies import zero
    model = spec.model
    ls = leaves(model)
    local = sum(leaf.local_size(spec) for leaf in ls)
    gathered = [leaf.local_size(spec, drop=("fsdp",)) for leaf in ls]
    per_layer = sum(g for g, leaf in zip(gathered, ls) if leaf.stacked) / max(
        1, math.ceil(model.n_layers / spec.deg("pp")))
    if not model.scan_layers:
        per_layer = max(sum(g for g, leaf in zip(gathered, ls)      # the largest layer
                            if leaf.path.startswith(f"layers/{i}/"))
                        for i in range(model.n_layers))
    return Shards(
        params=local / zero.shard_factor(spec, "params"),
        grads=local / zero.shard_factor(spec, "grads"),
        optimizer=local / zero.shard_factor(spec, "optimizer"),
        gathered_layer=per_layer,
        total=sum(leaf.size for leaf in ls),
    )
