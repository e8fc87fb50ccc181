"""The parameter table of jaxscale's LLaMA model and how a plan shards it, without building it.

`leaves(model)` lists every parameter the model creates (`models/llama.py`), with its shape, its
logical axes (the names the model annotates it with) and its *use*: `dot` for a weight contracted
in a matmul, `norm` for an RMSNorm scale (its gradient is a `reduce_sum`), `embedding` for the
token table (its gradient is a scatter-add). The use decides how XLA reduces its gradient (see
`comm.py`). `tests/test_planner.py` checks the table against the real model's abstract
parameters and logical specs, so the two cannot drift apart.

Sharding follows jaxscale's rules (`plan.py`, `strategies/`), written here as data:

| logical axis                        | mesh axes                          |
|-------------------------------------|------------------------------------|
| batch                               | dp, fsdp, ep (the data axes)       |
| seq (activations)                   | sp (context parallelism)           |
| embed                               | fsdp                               |
| heads, kv_heads, mlp, vocab         | tp                                 |
| layers                              | pp                                 |
| experts                             | ep                                 |

ZeRO (`plan.zero`) shards, on top of that, over the `dp` axis: stage 1 the optimizer state,
stage 2 also the gradients, stage 3 also the parameters (ZeRO, arXiv 1910.02054). The `fsdp`
axis always shards all three (it *is* ZeRO-3 over its devices).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

#: logical axis -> mesh axes it is split over
RULES: dict[str, tuple[str, ...]] = {
    "batch": ("dp", "fsdp", "ep"), "seq": ("sp",), "embed": ("fsdp",), "heads": ("tp",),
    "kv_heads": ("tp",), "mlp": ("tp",), "vocab": ("tp",), "layers": ("pp",),
    "experts": ("ep",), "head_dim": (),
}


@dataclass(frozen=True)
class MoE:
    """A mixture-of-experts MLP in every layer (Mixtral style): `n_experts` SwiGLU experts of the
    model's ffn_dim, a linear router, each token sent to `top_k` experts with `capacity` slack."""
    n_experts: int = 8
    top_k: int = 2
    capacity: float = 1.25


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

    def local_size(self, degrees: dict[str, int], drop: tuple[str, ...] = ()) -> float:
        """Elements per device: each dimension divided by the degrees of the mesh axes its
        logical axis maps to (`drop`: mesh axes treated as gathered)."""
        n = 1.0
        for dim, ax in zip(self.shape, self.axes):
            split = math.prod(degrees.get(m, 1) for m in RULES.get(ax, ()) if m not in drop)
            n *= math.ceil(dim / split)
        return n

    def split_over(self, degrees: dict[str, int]) -> tuple[str, ...]:
        """Mesh axes (degree > 1) this parameter is sharded over."""
        out = []
        for ax in self.axes:
            out += [m for m in RULES.get(ax, ()) if degrees.get(m, 1) > 1 and m not in out]
        return tuple(out)


def leaves(model, moe: MoE | None = None) -> list[Leaf]:
    """Every parameter of `jaxscale.models.llama.Llama(model)` (stacked over `layers` when scanned)."""
    d, f, hd, H, K, V = (model.dim, model.ffn_dim, model.hd, model.n_heads, model.n_kv_heads,
                         model.vocab_size)
    per_layer = [
        ("attn_norm/scale", (d,), ("embed",), "norm"),
        ("attn/wq", (d, H, hd), ("embed", "heads", "head_dim"), "dot"),
        ("attn/wk", (d, K, hd), ("embed", "kv_heads", "head_dim"), "dot"),
        ("attn/wv", (d, K, hd), ("embed", "kv_heads", "head_dim"), "dot"),
        ("attn/wo", (H, hd, d), ("heads", "head_dim", "embed"), "dot"),
        ("mlp_norm/scale", (d,), ("embed",), "norm"),
    ]
    if moe is None:
        per_layer += [("mlp/w_gate", (d, f), ("embed", "mlp"), "dot"),
                      ("mlp/w_up", (d, f), ("embed", "mlp"), "dot"),
                      ("mlp/w_down", (f, d), ("mlp", "embed"), "dot")]
    else:
        E = moe.n_experts
        per_layer += [("mlp/router", (d, E), ("embed", None), "router"),
                      ("mlp/w_gate", (E, d, f), ("experts", "embed", "mlp"), "dot"),
                      ("mlp/w_up", (E, d, f), ("experts", "embed", "mlp"), "dot"),
                      ("mlp/w_down", (E, f, d), ("experts", "mlp", "embed"), "dot")]
    out = [Leaf("embed", (V, d), ("vocab", "embed"), "embedding")]
    if model.scan_layers:
        out += [Leaf(f"layers/{p}", (model.n_layers,) + s, ("layers",) + a, u)
                for p, s, a, u in per_layer]
    else:
        out += [Leaf(f"layers/{i}/{p}", s, a, u)
                for i in range(model.n_layers) for p, s, a, u in per_layer]
    out.append(Leaf("norm/scale", (d,), ("embed",), "norm"))
    if not model.tie_embeddings:
        out.append(Leaf("head", (d, V), ("embed", "vocab"), "dot"))
    return out


def count(model, moe: MoE | None = None) -> int:
    """Total parameters (equals `ModelConfig.param_count()` for a dense model)."""
    return sum(leaf.size for leaf in leaves(model, moe))


def active_count(model, moe: MoE | None = None) -> int:
    """Parameters a token passes through (MoE: top_k of the experts)."""
    if moe is None:
        return count(model)
    expert = 3 * model.dim * model.ffn_dim * model.n_layers
    return count(model, moe) - (moe.n_experts - moe.top_k) * expert


@dataclass(frozen=True)
class Shards:
    """Per-device element counts of the model state under a plan."""
    params: float                 # stored parameters (after fsdp/tp/pp/ep and ZeRO-3 over dp)
    grads: float                  # gradients after reduction (ZeRO-2/3: also over dp)
    optimizer: float              # elements of one optimizer moment (ZeRO-1+: also over dp)
    gathered_layer: float         # one layer's parameters once gathered over fsdp (and dp, ZeRO-3)
    unreduced_grads: float        # gradients before the data-axis reduction (fsdp/dp gathered)
    total: int


def shards(model, degrees: dict[str, int], zero: int = 0, moe: MoE | None = None) -> Shards:
    dp = degrees.get("dp", 1)
    ls = leaves(model, moe)
    local = sum(leaf.local_size(degrees) for leaf in ls)
    gathered = [leaf.local_size(degrees, drop=("fsdp",)) for leaf in ls]
    per_layer = sum(g for g, leaf in zip(gathered, ls) if leaf.stacked) / max(
        1, math.ceil(model.n_layers / degrees.get("pp", 1)))
    if not model.scan_layers:
        per_layer = sum(g for g, leaf in zip(gathered, ls) if leaf.path.startswith("layers/0/"))
    return Shards(
        params=local / (dp if zero >= 3 else 1),
        grads=local / (dp if zero >= 2 else 1),
        optimizer=local / (dp if zero >= 1 else 1),
        gathered_layer=per_layer,
        unreduced_grads=sum(gathered),
        total=sum(leaf.size for leaf in ls),
    )
