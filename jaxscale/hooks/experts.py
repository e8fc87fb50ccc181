"""A mixture of experts' dispatch of tokens to expert slots and back, through one seam.

`models/moe.py` routes each token to k experts and calls, with its own local functions:

- `to_experts(scatter, x, idx, pos)`: `scatter` fills the [E, B, C, D] slot buffer from the
  tokens [B, T, D], their experts `idx` and slot positions `pos` [B, T, k];
- `from_experts(gather, out, idx, pos, w)`: `gather` weights and sums each token's expert
  outputs back into [B, T, D];
- `on_data_shards(fn, x, idx, w, w_gate, w_up, w_down)`: dropless experts without expert
  parallelism, `fn` on each data shard (sorted rows through `jax.lax.ragged_dot`).

Outside a plan each is the local call. Under a plan the rules' `experts` seam names the
implementation that runs them per data shard inside `jax.shard_map`, with the all-to-alls over
the mesh axes the `experts` axis is split over (`jaxscale.strategies.ep`).
"""
from __future__ import annotations

from jaxscale.axes import active
from jaxscale.hooks import implementation


def experts_split() -> bool:
    """Whether the rules in force split the logical `experts` axis (expert parallelism)."""
    ctx = active()
    return bool(ctx and ctx[1].table.get("experts"))


def to_experts(scatter, x_BTD, idx_BTK, pos_BTK):
    found = implementation("experts")
    if found is None:
        return scatter(x_BTD, idx_BTK, pos_BTK)
    impl, mesh, rules = found
    return impl.to_experts(mesh, rules, scatter, x_BTD, idx_BTK, pos_BTK)


def from_experts(gather, out_EBCD, idx_BTK, pos_BTK, w_BTK):
    found = implementation("experts")
    if found is None:
        return gather(out_EBCD, idx_BTK, pos_BTK, w_BTK)
    impl, mesh, rules = found
    return impl.from_experts(mesh, rules, gather, out_EBCD, idx_BTK, pos_BTK, w_BTK)


def on_data_shards(fn, x_BTD, idx_BTK, w_BTK, w_gate, w_up, w_down):
    found = implementation("experts")
    if found is None:
        return fn(x_BTD, idx_BTK, w_BTK, w_gate, w_up, w_down)
    impl, mesh, rules = found
    return impl.on_data_shards(mesh, rules, fn, x_BTD, idx_BTK, w_BTK, w_gate, w_up, w_down)
