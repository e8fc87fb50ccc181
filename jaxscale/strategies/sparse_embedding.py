"""Sparse embedding-gradient exchange over `dp`: only the table rows a replica's tokens touched.

`plan.sparse_embedding=true`. On a data-parallel replica the embedding table's gradient [V, D] is
zero outside the rows of the token ids it saw: at most R = min(B_dp x T, V) rows (B_dp the
replica's sequences, its micro-batches and its fsdp/ep shares included). Instead of all-reducing
the dense gradient over dp, each device takes the sorted unique ids of its replica's rows that
fall in its own piece of the table (`jnp.unique`, padded to a static size with an out-of-range
id), and its gradient rows of them [R, D / (its embed split)], all-gathers both over dp, and
scatter-adds the N x R rows into a zero piece of the table (the padding dropped); dividing by N
gives the mean, equal to the dense all-reduce's up to the order of the fp32 sums. It runs as the
data region's mean (`strategies.dp.region`): on each device's own shards, so the table may be
split over tp (vocabulary: a device exchanges only ids of its rows, R <= V / tp) and fsdp (the
embedding dimension: its columns of each row). The other gradients take their plain mean (one
fp32 all-reduce), or `plan.compression`'s compressed one.

Collectives per step (N = dp): all-gather of N R int32 ids (4 N R bytes) and of N R D_local fp32
rows (4 N R D_local bytes), in place of the embedding's all-reduce (4 V D_local / tp bytes); the
other gradients' all-reduce; the loss and token count; where fsdp or ep split the batch too, the ids
of the replica's rows gathered over them (4 B_dp T bytes), which the mean's region reads. Link bytes
per device: (N - 1) R (D_local + 1) 4 against the all-reduce's 2 (N - 1)/N V_local D_local 4, so the
exchange pays while R (D + 1) < 2 V D / N, roughly B_dp T < 2 V / N: large vocabularies, short
batches per replica (recommender tables, LLM vocabularies of 128K+ with a few thousand tokens per
replica). Beyond that the dense all-reduce costs less (an all-gather does not shrink with N). Costs:
the gathered rows, 4 N R (D_local + 1) bytes of temporaries, and a sort (`jnp.unique`) of the
replica's B_dp x T ids.

Needs an untied embedding (a tied table is also the LM head, whose gradient is dense in every
row, so there is nothing sparse to exchange) and a gradient mean to replace (local SGD averages
parameters instead).
"""
from __future__ import annotations

import math

from jaxscale.strategies import compression, dp
from jaxscale.strategies.common import Comm, Term
from jaxscale.strategies.tables.params import leaves

NAME = "sparse_embedding"
AVAILABLE = True


def active(spec) -> bool:
    return bool(spec.sparse_embedding)


def vocab_split(spec) -> int:
    """How many ways the table's vocabulary is split (tp's vocabulary parallelism)."""
    return math.prod(spec.deg(a) for a in spec.rules.table.get("vocab", ()))


def rows(spec) -> int:
    """R: the static number of rows a device sends, min(B_dp x T, V / its vocabulary split),
    B_dp its rows of the batch (of a micro-batch, when the exchange runs once per micro-batch:
    `dp.mean_runs`)."""
    return int(min(spec.batch / spec.deg("dp") / dp.mean_runs(spec) * spec.seq,
                   spec.model.padded_vocab // vocab_split(spec)))


def _table(spec):
    return next(leaf for leaf in leaves(spec.model) if leaf.use == "embedding")


def problems(spec) -> list[str]:
    if not active(spec):
        return []
    errs = []
    if spec.deg("dp") == 1:
        errs.append("plan.sparse_embedding exchanges the embedding gradient's rows over mesh.dp, "
                    "but mesh.dp=1: give the devices to dp, or set plan.sparse_embedding=false")
    if spec.local_sgd != "none":
        errs.append(f"plan.sparse_embedding with plan.local_sgd={spec.local_sgd}: local SGD "
                    f"averages parameters and has no gradient mean to replace; choose one")
    if getattr(spec.model, "tie_embeddings", False):
        errs.append("plan.sparse_embedding with model.tie_embeddings=true: a tied table is also "
                    "the LM head, whose gradient is dense in every row; untie it or set "
                    "plan.sparse_embedding=false")
    return errs


def rules(spec, rules) -> None:
    """No sharding rule of its own."""


def collectives(spec) -> list[Comm]:
    if not active(spec):
        return []
    n, R = spec.deg("dp"), rows(spec)
    table = _table(spec)
    d_local = table.local_shape(spec)[1]
    runs = dp.mean_runs(spec)
    out = [Comm("all-gather", ("dp",), 4 * n * R * (d_local + 1) * runs, 2 * runs,
                f"embedding gradient: {R} touched row ids (int32) and rows (fp32) per device"
                + (f", once per micro-batch ({runs})" if runs > 1 else ""),
                group=n, overlap=True)]
    others = tuple(a for a in spec.data_axes if a != "dp")
    if others:      # its mean reads the token ids of its dp shard's rows, gathered over the rest
        out.append(Comm("all-gather", others, 4 * spec.batch / n * spec.seq, runs,
                        "the token ids of the dp shard's rows, for its touched rows",
                        group=math.prod(spec.deg(a) for a in others)))
    if spec.compression != "none":
        return out            # the other gradients: compression's rows
    rest = sum(leaf.local_size(spec) for leaf in leaves(spec.model) if leaf.use != "embedding")
    return out + [Comm("all-reduce", ("dp",), 4 * rest * runs, runs,
                       "the other gradients' mean", group=n, overlap=True)]


def dense_bytes(spec) -> float:
    """What the dense exchange all-reduces for the embedding: 4 V D bytes of a device's piece."""
    return 4 * _table(spec).local_size(spec)


def memory(spec) -> list[Term]:
    if not active(spec):
        return []
    n, R = spec.deg("dp"), rows(spec)
    d_local = _table(spec).local_shape(spec)[1]
    return [Term("backward", 4 * n * R * (d_local + 1),
                 "sparse embedding exchange: gathered rows")]


def label(spec) -> list[str]:
    return ["sparse-embed"] if active(spec) else []


# ----------------------------------------------------------------------------- the step side
def shape_step(spec, parts) -> None:
    """The step: the gradient mean over dp by the exchange of touched rows for the embedding
    (`mean`), in the data region (`strategies.dp` sets it); the other gradients' by compression's
    method when `plan.compression` is on, else exact."""
    if active(spec):
        parts.set("mean", lambda ctx: mean(spec), by=NAME)


def mean(spec, key: str = "embed"):
    """(a device's gradient shards, state, its replica's input ids) -> (mean gradients, state),
    inside the data region's mean (`shard_map` manual over the whole mesh)."""
    import jax
    import jax.numpy as jnp

    from jaxscale.strategies.compression.methods import invariant_all_gather
    n, R = spec.deg("dp"), rows(spec)
    vocab_axes = tuple(a for a in spec.rules.table.get("vocab", ()) if spec.deg(a) > 1)
    others_mean = compression.mean(spec) if compression.active(spec) else None

    def fn(grads, state, inputs):
        table_VD = grads[key]                                    # this device's piece
        V = table_VD.shape[0]
        first = jax.lax.axis_index(vocab_axes) * V if vocab_axes else 0
        others = {k: v for k, v in grads.items() if k != key}
        if others_mean is None:
            others = jax.tree.map(lambda g: g / n, jax.lax.psum(others, "dp"))
        else:
            others, state = others_mean(others, state, inputs)
        ids = inputs.reshape(-1) - first
        ids = jnp.where((ids >= 0) & (ids < V), ids, V)          # V: not in this piece
        ids_R = jnp.unique(ids, size=R, fill_value=V).astype(jnp.int32)
        rows_RD = table_VD.at[ids_R].get(mode="fill", fill_value=0).astype(jnp.float32)
        all_ids = invariant_all_gather(ids_R, "dp")              # [N R]
        all_rows = invariant_all_gather(rows_RD, "dp")           # [N R, D]
        dense_VD = jnp.zeros(table_VD.shape, jnp.float32).at[all_ids].add(all_rows, mode="drop")
        return {**others, key: (dense_VD / n).astype(table_VD.dtype)}, state
    return fn
