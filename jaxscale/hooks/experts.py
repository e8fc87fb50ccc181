"""A mixture of experts' dispatch of tokens to their experts and back, through one seam.

`models/moe.py` routes each token to k experts and calls, with its own local functions:

- `to_experts(scatter, x, idx, pos)`: `scatter` fills the [E, B, C, D] slot buffer from the
  tokens [B, T, D], their experts `idx` and slot positions `pos` [B, T, k];
- `from_experts(gather, out, idx, pos, w)`: `gather` weights and sums each token's expert
  outputs back into [B, T, D];
- `grouped(parts, x, idx, w, weights, capacity)`: the grouped experts (assignments sorted by
  expert, `jax.lax.ragged_dot` over the rows): dropless (`capacity` None), or with `capacity`
  slots per expert and sequence; `parts` are the model's `local` (the whole computation on one
  shard), `ffn` (the experts over rows grouped by expert) and `positions` (each assignment's
  place in its expert's queue within its sequence). Returns (y [B, T, D], the number of
  assignments that reached no expert).

Outside a plan each is the local call. Under a plan the rules' `experts` seam names the
implementation that runs them per data shard inside `jax.shard_map`, with the all-to-alls over
the mesh axes the `experts` axis is split over (`jaxscale.strategies.ep`).
"""
from __future__ import annotations

from jaxscale.axes import active
from jaxscale.hooks import implementation


def grouped_only() -> bool:
    """Whether the plan in force runs its mixtures as grouped experts (the choice of
    `jaxscale.strategies.tables.activations.grouped`, an option of the `experts` seam)."""
    ctx = active()
    return bool(ctx and ctx[1].options.get("experts", {}).get("grouped"))


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


def grouped(parts, x_BTD, idx_BTK, w_BTK, weights, capacity=None):
    found = implementation("experts")
    if found is None:
        return parts.local(x_BTD, idx_BTK, w_BTK, weights, capacity)
    impl, mesh, rules = found
    return impl.grouped(mesh, rules, parts, x_BTD, idx_BTK, w_BTK, weights, capacity)
