"""The slot buffer's dispatch under a plan (capacity mode on whole sequences): each data shard
scatters its own tokens into its [E, b, C, D] slot buffer inside `jax.shard_map` over the mesh;
with `experts` split over mesh axes, one all-to-all over them sends each expert's slots to the
device holding it (and the inverse one brings them back). The expert MLP between is
GSPMD-sharded by the rules (`models/moe.py`'s `expert_ffn`)."""
from __future__ import annotations

from jaxscale.axes import mesh_entry, suspended


def to_experts(mesh, rules, scatter, x_BTD, idx_BTK, pos_BTK):
    """The global buffer [E, B, C, D]: experts over ep, rows over the other data axes."""
    import jax
    from jax import lax
    ex = rules.table.get("experts", ())
    tok, buf = rules.spec(("batch", None, None)), rules.spec(("experts", "batch", None, None))

    def body(x, idx, pos):
        with suspended():
            b = scatter(x, idx, pos)
        return lax.all_to_all(b, mesh_entry(ex), 0, 1, tiled=True) if ex else b
    return jax.shard_map(body, mesh=mesh, in_specs=(tok, tok, tok), out_specs=buf)(
        x_BTD, idx_BTK, pos_BTK)


def from_experts(mesh, rules, gather, out_EBCD, idx_BTK, pos_BTK, w_BTK):
    """Each slot back on its token's device, where `gather` weights and sums: [B, T, D]."""
    import jax
    from jax import lax
    ex = rules.table.get("experts", ())
    tok, buf = rules.spec(("batch", None, None)), rules.spec(("experts", "batch", None, None))

    def body(out, idx, pos, w):
        out = lax.all_to_all(out, mesh_entry(ex), 1, 0, tiled=True) if ex else out
        with suspended():
            return gather(out, idx, pos, w)
    return jax.shard_map(body, mesh=mesh, in_specs=(buf, tok, tok, tok), out_specs=tok)(
        out_EBCD, idx_BTK, pos_BTK, w_BTK)
