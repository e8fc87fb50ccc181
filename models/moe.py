"""Mixture-of-experts feed-forward block (Mixtral style): router, dispatch, experts, losses.

A block with `model.moe_experts = E > 0` replaces the dense SwiGLU MLP of every
`model.moe_every`-th layer (layers n-1, 2n-1, ...; all of them for n = 1, the only choice with
`scan_layers`, which stacks identical layers) by E SwiGLU experts and a linear router.

Parameters of one MoE layer (with `scan_layers` each has a leading `layers` axis of n_layers):

| path (under `layers/` or `layers/<i>/`) | shape           | logical axes                   |
|-----------------------------------------|-----------------|--------------------------------|
| `mlp/router`                            | [dim, E]        | ("embed", None)                |
| `mlp/w_gate`                            | [E, dim, ffn]   | ("experts", "embed", "mlp")    |
| `mlp/w_up`                              | [E, dim, ffn]   | ("experts", "embed", "mlp")    |
| `mlp/w_down`                            | [E, ffn, dim]   | ("experts", "mlp", "embed")    |

Expert e computes `(silu(x @ w_gate[e]) * (x @ w_up[e])) @ w_down[e]`, the dense MLP's function.
Hugging Face Mixtral stores the same weights transposed, as `nn.Linear` does: per layer,
`block_sparse_moe.gate.weight` [E, dim] = router.T, `block_sparse_moe.experts.<e>.w1.weight`
[ffn, dim] = w_gate[e].T, `.w3.weight` [ffn, dim] = w_up[e].T, `.w2.weight` [dim, ffn] =
w_down[e].T; its routing is the one below (softmax over all E in fp32, top-k, renormalised).

Routing, per token: logits = x @ router (fp32 accumulation); p = softmax(logits); the top-k
experts by p (ties: the lower index); their weights p / sum(top-k p), summing to 1. The output is
sum_j w_j expert_{e_j}(x) over the token's kept assignments; a dropped assignment adds nothing
(the token keeps its residual), and the weights are not renormalised over what was kept.

Losses (returned as statistics, weighted into the training loss by `jaxscale/train/grads.py`):
- load balancing (Switch Transformer, arXiv 2101.03961): E * sum_e f_e * P_e, with f_e the
  fraction of the k N assignments of the N tokens that chose expert e (before capacity; a
  constant to the gradient) and P_e the mean router probability of e. 1.0 when balanced, E when
  one expert takes everything. (Hugging Face's `load_balancing_loss_func` reports k times this
  value: it normalises f by N, not k N.) Weight `model.moe_aux_weight`.
- router z-loss (ST-MoE, arXiv 2202.08906): mean over tokens of logsumexp(logits)^2, keeping the
  router logits small. Weight `model.moe_z_weight`.
Both are averaged over the MoE layers, over the whole global batch (the router runs in the
global, GSPMD view, so every data-parallel degree computes the same value).

Dispatch, two ways (each through the `experts` seam, `jaxscale.hooks.experts`; under a plan
inside `jax.shard_map`, `jaxscale.strategies.ep`):

- capacity slots (capacity mode on whole sequences): each expert has `cfg.moe_capacity(T)` = C
  = ceil(capacity_factor x T x k / E) slots per *sequence* (at most T: an expert takes a token
  at most once). Within a sequence, assignments claim slots in token order, a token's choices
  in rank order; one past its expert's capacity is dropped. So (1) a token's fate depends only
  on earlier tokens of its own sequence: the model stays causal, and (2) the same tokens drop
  whatever the data, expert, tensor or sequence parallel layout or the micro-batching: sharded
  runs equal one device even when tokens drop. Tokens are scattered into a buffer [E, B, C, dim]
  (`scatter_to_slots`), the experts run as batched matmuls over it (`expert_ffn`), and the
  results are gathered back and weighted (`gather_from_slots`); expert parallelism moves the
  buffer with one all-to-all each way.
- grouped experts (dropless, `model.moe_dropless`, or a sequence split over devices): the kept
  assignments sorted by expert, the experts as grouped matmuls (`jax.lax.ragged_dot`) over
  exactly the routed rows (`ragged_experts` on one shard, `grouped_ffn` the experts). Under
  expert parallelism the rows travel in bounded blocks (`plan.moe_buffer` times the balanced
  share per peer: the routed volume, not a worst-case buffer); capacity, where it applies, is
  still counted over the whole sequence in token order.

Remat: the expert activations carry the dense MLP's tags (`mlp_gate`, `mlp_up`, `mlp_hidden`,
`mlp_down`), so name-based policies treat both alike; `save_dots` keeps only matmuls without
batch dimensions, and the expert matmuls have one (the expert), so it recomputes them.
"""
from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from jaxscale.axes import constrain, data_mean
from jaxscale.hooks import experts
from jaxscale.hooks.projection import project_grouped
from jaxscale.models.layers import param, swiglu

F32 = jnp.float32
#: the statistics one MoE layer returns (each a scalar, but `expert_share` [E])
STATS = ("aux_loss", "z_loss", "dropped", "routed", "expert_share")


# ----------------------------------------------------------------------------- routing
def route(x_BTD, router_DE, k: int, bias_E=None):
    """(logits [B,T,E] fp32, probabilities [B,T,E], top-k weights [B,T,k] summing to 1,
    top-k expert ids [B,T,k]). With a routing bias (auxiliary-loss-free balancing) the experts
    are chosen by probability + bias, and weighted by their probabilities alone."""
    logits = jnp.einsum("btd,de->bte", x_BTD, router_DE.astype(x_BTD.dtype),
                        preferred_element_type=F32)
    probs = jax.nn.softmax(logits, axis=-1)
    scores = probs if bias_E is None else probs + lax.stop_gradient(bias_E).astype(F32)
    top_p, idx = top_k(scores, k, probs)
    return logits, probs, top_p / jnp.sum(top_p, -1, keepdims=True), idx


def top_k(scores_BTE, k: int, values_BTE=None):
    """The experts of the k largest scores and their values (`values`, default the scores), by
    k rounds of argmax (the lower index wins a tie, as `lax.top_k`): element-wise and
    reductions along E only, which GSPMD keeps on each batch shard (its `lax.top_k`
    partitioning gathers the whole batch)."""
    values = scores_BTE if values_BTE is None else values_BTE
    vals, idx, p = [], [], scores_BTE
    for _ in range(k):
        i = jnp.argmax(p, axis=-1)
        hit = jax.nn.one_hot(i, scores_BTE.shape[-1], dtype=jnp.bool_)
        vals.append(jnp.sum(jnp.where(hit, values, 0.0), axis=-1))
        idx.append(i.astype(jnp.int32))
        p = jnp.where(hit, -jnp.inf, p)
    return jnp.stack(vals, -1), jnp.stack(idx, -1)


def expert_share(idx_BTK, n_experts: int):
    """[E]: the fraction of all assignments (k per token) that chose each expert (sums to 1)."""
    counts = jnp.sum(jax.nn.one_hot(idx_BTK, n_experts, dtype=F32), axis=(0, 1, 2))
    return counts / idx_BTK.size


def balance_loss(probs_BTE, share_E):
    """Switch load balancing: E * sum_e f_e P_e (f a constant to the gradient), f and P over the
    whole batch: inside a region manual over data axes, their means over the data shards
    (`axes.data_mean`; the loss is a product of two means, not a mean itself)."""
    E = probs_BTE.shape[-1]
    mean_p = data_mean(jnp.mean(probs_BTE, axis=(0, 1)))
    return E * jnp.sum(lax.stop_gradient(share_E) * mean_p)


#: the load signal's scale: tiny beside any gradient (the global norm and clipping do not see
#: it), its sign all the update reads
LOAD_SIGNAL = 1e-8


@jax.custom_vjp
def load_signal(bias_E, share_E):
    """The routing bias, unchanged; its cotangent is the load imbalance share - mean(share)
    (times `LOAD_SIGNAL`), whatever the loss: the bias's "gradient" rides the gradient path (its
    mean over the data shards and micro-batches included), and the optimizer steps it by
    -rate x sign (`jaxscale.train.state.make_optimizer`): DeepSeek-V3's b += rate x sign(mean -
    load). The loss must read the output (a zero-weighted term) for the cotangent to flow."""
    return bias_E


def _signal_fwd(bias_E, share_E):
    return bias_E, share_E


def _signal_bwd(share_E, g_E):
    return ((share_E - jnp.mean(share_E)) * LOAD_SIGNAL).astype(g_E.dtype), jnp.zeros_like(share_E)


load_signal.defvjp(_signal_fwd, _signal_bwd)


def z_loss(logits_BTE):
    return jnp.mean(jnp.square(jax.nn.logsumexp(logits_BTE, axis=-1)))


def slot_positions(idx_BTK, n_experts: int):
    """[B,T,k]: each assignment's place in its expert's queue within its sequence (token order,
    a token's choices in rank order; 0 = first). >= capacity means dropped."""
    B, T, K = idx_BTK.shape
    onehot = jax.nn.one_hot(idx_BTK.reshape(B, T * K), n_experts, dtype=jnp.int32)
    before = jnp.cumsum(onehot, axis=1) - onehot            # earlier claims on the same expert
    return jnp.sum(before * onehot, axis=-1).reshape(B, T, K)


# ----------------------------------------------------------------------------- local pieces
def _rows(idx_BTK):
    return jnp.broadcast_to(jnp.arange(idx_BTK.shape[0])[:, None, None], idx_BTK.shape)


def scatter_to_slots(x_BTD, idx_BTK, pos_BTK, *, n_experts: int, capacity: int):
    """Tokens into their expert slots: [E, B, C, D] (empty slots zero; dropped ones skipped)."""
    B, T, D = x_BTD.shape
    upd = jnp.broadcast_to(x_BTD[:, :, None, :], (*idx_BTK.shape, D))
    buf = jnp.zeros((n_experts, B, capacity, D), x_BTD.dtype)
    return buf.at[idx_BTK, _rows(idx_BTK), pos_BTK].add(upd, mode="drop")


def gather_from_slots(out_EBCD, idx_BTK, pos_BTK, w_BTK):
    """Each token's expert outputs back from the slots, weighted and summed: [B, T, D]."""
    C = out_EBCD.shape[2]
    keep = pos_BTK < C
    y_BTKD = out_EBCD[idx_BTK, _rows(idx_BTK), jnp.where(keep, pos_BTK, 0)]
    w = jnp.where(keep, w_BTK, 0.0).astype(y_BTKD.dtype)
    return jnp.sum(y_BTKD * w[..., None], axis=2)


def expert_ffn(buf_EBCD, w_gate, w_up, w_down):
    """SwiGLU of every expert over its slots (batched matmuls; GSPMD shards `experts`, the rows
    over the data axes and `mlp` over tp as the rules say)."""
    dt = buf_EBCD.dtype
    buf = constrain(buf_EBCD, "experts", "batch", None, "embed")
    g = checkpoint_name(jnp.einsum("ebcd,edf->ebcf", buf, w_gate.astype(dt)), "mlp_gate")
    u = checkpoint_name(jnp.einsum("ebcd,edf->ebcf", buf, w_up.astype(dt)), "mlp_up")
    h = constrain(checkpoint_name(jax.nn.silu(g) * u, "mlp_hidden"),
                  "experts", "batch", None, "mlp")
    out = checkpoint_name(jnp.einsum("ebcf,efd->ebcd", h, w_down.astype(dt)), "mlp_down")
    return constrain(out, "experts", "batch", None, "embed")


def grouped_ffn(xs_RD, sizes_E, w_gate, w_up, w_down):
    """SwiGLU of every expert over rows grouped by expert (`sizes_E` rows each, in expert order;
    rows past their sum give zeros): grouped matmuls, `jax.lax.ragged_dot`. [R, D]."""
    g = checkpoint_name(project_grouped(xs_RD, w_gate, sizes_E, "w_gate"), "mlp_gate")
    u = checkpoint_name(project_grouped(xs_RD, w_up, sizes_E, "w_up"), "mlp_up")
    h = checkpoint_name(jax.nn.silu(g) * u, "mlp_hidden")
    return checkpoint_name(project_grouped(h, w_down, sizes_E, "w_down"), "mlp_down")


def kept(idx_BTK, n_experts: int, capacity: int | None):
    """[B,T,k] bool: the assignments that reach their expert (all of them when dropless)."""
    if capacity is None:
        return jnp.ones(idx_BTK.shape, jnp.bool_)
    return slot_positions(idx_BTK, n_experts) < capacity


def ragged_experts(x_BTD, idx_BTK, w_BTK, weights, capacity=None):
    """The grouped experts on one shard: the kept assignments sorted by expert (dropped ones
    last, computing nothing), `grouped_ffn`, unsorted, weighted and summed. (y [B, T, D], the
    number of dropped assignments)."""
    B, T, D = x_BTD.shape
    K, E = idx_BTK.shape[-1], weights[0].shape[0]
    keep = kept(idx_BTK, E, capacity).reshape(-1)
    key = jnp.where(keep, idx_BTK.reshape(-1), E)               # [N k], token-major
    order = jnp.argsort(key, stable=True)
    sizes = jnp.sum(jax.nn.one_hot(key, E, dtype=jnp.int32), axis=0)
    xs = x_BTD.reshape(B * T, D)[order // K]                    # [N k, D], grouped by expert
    y = grouped_ffn(xs, sizes, *weights)[jnp.argsort(order)].reshape(B, T, K, D)
    y = jnp.sum(y * w_BTK[..., None].astype(y.dtype), axis=2)
    return y, jnp.sum(~keep).astype(F32)


class Grouped(NamedTuple):
    """The model's pieces of the grouped experts, for the `experts` seam (`hooks.experts`)."""
    local: Callable = ragged_experts
    ffn: Callable = grouped_ffn
    positions: Callable = slot_positions


# ----------------------------------------------------------------------------- the block
class MoE(nnx.Module):
    """Router + E SwiGLU experts; __call__(x [B,T,D]) -> (y [B,T,D], statistics `STATS`)."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        d, f, E, pd, std = (cfg.dim, cfg.expert_ffn, cfg.moe_experts, jnp.dtype(cfg.param_dtype),
                            cfg.init_std)
        down = std / math.sqrt(2 * cfg.n_layers)
        self.router = param(rngs, (d, E), ("embed", None), pd, std)
        self.w_gate = param(rngs, (E, d, f), ("experts", "embed", "mlp"), pd, std)
        self.w_up = param(rngs, (E, d, f), ("experts", "embed", "mlp"), pd, std)
        self.w_down = param(rngs, (E, f, d), ("experts", "mlp", "embed"), pd, down)
        if cfg.moe_bias_rate:
            self.router_bias = nnx.Param(jnp.zeros((E,), pd), out_sharding=(None,),
                                         eager_sharding=False)
        if cfg.moe_shared_experts:       # one SwiGLU as wide as the shared experts together
            fs = cfg.moe_shared_experts * f
            self.shared_gate = param(rngs, (d, fs), ("embed", "mlp"), pd, std)
            self.shared_up = param(rngs, (d, fs), ("embed", "mlp"), pd, std)
            self.shared_down = param(rngs, (fs, d), ("mlp", "embed"), pd, down)
        self.cfg = cfg

    def shared(self, x_BTD):
        """The shared experts, a dense SwiGLU every token passes through, by the model's weight
        matmul sites (`shared_gate`, `shared_up`, `shared_down`: tensor parallelism and its
        column group apply as to the dense MLP)."""
        return swiglu(x_BTD, self.shared_gate[...], self.shared_up[...], self.shared_down[...],
                      ("shared_gate", "shared_up", "shared_down"))

    def __call__(self, x_BTD):
        cfg = self.cfg
        E, K = cfg.moe_experts, cfg.moe_top_k
        B, T, _ = x_BTD.shape
        # the router is read whole (gathered like an FSDP weight at use): left to itself GSPMD
        # splits its contraction over tp and all-reduces the logits
        bias = self.router_bias[...] if cfg.moe_bias_rate else None
        logits, probs, w, idx = route(x_BTD, constrain(self.router[...], None, None), K, bias)
        share = data_mean(expert_share(idx, E))
        weights = self.w_gate[...], self.w_up[...], self.w_down[...]
        C = None if cfg.moe_dropless else cfg.moe_capacity(T)
        if C is None or experts.grouped_only():
            y, dropped = experts.grouped(Grouped(), x_BTD, idx, w, weights, C)
        else:
            pos = slot_positions(idx, E)
            buf = experts.to_experts(functools.partial(scatter_to_slots, n_experts=E, capacity=C),
                                x_BTD, idx, pos)
            y = experts.from_experts(gather_from_slots, expert_ffn(buf, *weights), idx, pos, w)
            dropped = jnp.sum(pos >= C).astype(F32)
        if cfg.moe_shared_experts:
            y = y + self.shared(x_BTD)
        aux = balance_loss(probs, share)
        if bias is not None:       # a zero-weighted read: the bias's load signal flows back
            aux = aux + 0.0 * jnp.sum(load_signal(bias, share))
        stats = {"aux_loss": aux, "z_loss": z_loss(logits),
                 "dropped": dropped, "routed": jnp.asarray(B * T * K, F32),
                 "expert_share": share}
        return y, stats


def summarise(stats: dict) -> dict:
    """The statistics of all MoE layers (each leaf stacked [layers, ...]) for one forward pass:
    `aux_loss` and `z_loss` averaged over the layers, `dropped` and `routed` assignments summed,
    `expert_share` [layers, E] as it was."""
    return {"aux_loss": jnp.mean(stats["aux_loss"]), "z_loss": jnp.mean(stats["z_loss"]),
            "dropped": jnp.sum(stats["dropped"]), "routed": jnp.sum(stats["routed"]),
            "expert_share": stats["expert_share"]}
