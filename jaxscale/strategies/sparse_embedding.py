"""Sparse embedding-gradient exchange over `dp`: only the table rows a device's tokens touched.

`plan.sparse_embedding=true`. On a data-parallel device the embedding table's gradient [V, D] is
zero outside the rows of the token ids it saw: at most R = min(B_local x T, V) rows (B_local the
device's sequences, its micro-batches included). Instead of all-reducing the dense [V, D]
gradient, each device takes its sorted unique ids (`jnp.unique`, padded to the static size R
with the out-of-range id V) and their gradient rows [R, D], all-gathers both over dp, and
scatter-adds the N x R rows into a zero table (the padding rows dropped); dividing by N gives the
mean, equal to the dense all-reduce's up to the order of the fp32 sums. The other gradients take
their plain mean (one fp32 all-reduce). Runs in `jax.shard_map` through gradient compression's
wrapper (`strategies.compression.wrap`, with this module's `mean`): each device's gradients are
weighted by its share of the real tokens, as there.

Collectives per step (N = dp): all-gather of N R int32 ids (4 N R bytes) and of N R D fp32 rows
(4 N R D bytes), in place of the embedding's all-reduce (4 V D bytes); the other gradients'
all-reduce; the token count. Link bytes per device: (N - 1) R (D + 1) 4 against the all-reduce's
2 (N - 1)/N V D 4, so the exchange pays while R (D + 1) < 2 V D / N, roughly B_local T < 2 V / N:
large vocabularies, short local batches (recommender tables, LLM vocabularies of 128K+ with a
few thousand tokens per device). Beyond that the dense all-reduce costs less (an all-gather does
not shrink with N). Costs: the gathered rows, 4 N R (D + 1) bytes of temporaries, and a sort
(`jnp.unique`) of the device's B_local x T ids.

Runs on plans over `dp` alone (ZeRO 0 or 1), an untied embedding (a tied table is also the LM
head, whose gradient is dense) and without `plan.compression`.
"""
from __future__ import annotations

from jaxscale.strategies import compression
from jaxscale.strategies.common import Comm, Term, dp_only
from jaxscale.strategies.tables.params import leaves

NAME = "sparse_embedding"
AVAILABLE = True


def active(spec) -> bool:
    return bool(spec.sparse_embedding)


def rows(spec) -> int:
    """R: the static number of rows a device sends, min(B_local x T, V)."""
    return int(min(spec.local_batch * spec.seq, spec.model.vocab_size))


def problems(spec) -> list[str]:
    if not active(spec):
        return []
    errs = []
    if spec.deg("dp") == 1:
        errs.append("plan.sparse_embedding exchanges the embedding gradient's rows over mesh.dp, "
                    "but mesh.dp=1: give the devices to dp, or set plan.sparse_embedding=false")
    errs += dp_only(spec, "plan.sparse_embedding", "", "plan.sparse_embedding=false")
    if spec.zero >= 2:
        errs.append(f"plan.sparse_embedding returns the whole mean gradient on every device, not "
                    f"the shards ZeRO-{spec.zero} keeps: use plan.zero=0 or 1")
    if spec.compression != "none":
        errs.append(f"plan.sparse_embedding and plan.compression={spec.compression} both replace "
                    f"the gradient mean: choose one")
    if spec.local_sgd != "none":
        errs.append(f"plan.sparse_embedding with plan.local_sgd={spec.local_sgd}: local SGD "
                    f"averages parameters, not gradients; choose one")
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
    n, R, D = spec.deg("dp"), rows(spec), spec.model.dim
    rest = sum(leaf.size for leaf in leaves(spec.model) if leaf.use != "embedding")
    return [Comm("all-reduce", ("dp",), 4 * rest, 1, "the other gradients' mean", group=n,
                 overlap=True),
            Comm("all-reduce", ("dp",), 4, 1, "token count (the loss denominator)", group=n),
            Comm("all-gather", ("dp",), 4 * n * R * (D + 1), 2,
                 f"embedding gradient: {R} touched row ids (int32) and rows (fp32) per device",
                 group=n, overlap=True)]


def dense_bytes(spec) -> int:
    """What the dense exchange all-reduces for the embedding: 4 V D bytes."""
    return 4 * spec.model.vocab_size * spec.model.dim


def memory(spec) -> list[Term]:
    if not active(spec):
        return []
    n, R, D = spec.deg("dp"), rows(spec), spec.model.dim
    return [Term("backward", 4 * n * R * (D + 1), "sparse embedding exchange: gathered rows")]


def label(spec) -> list[str]:
    return ["sparse-embed"] if active(spec) else []


# ----------------------------------------------------------------------------- the step side
def shape_step(spec, parts) -> None:
    """The step: the gradient mean over dp in shard_map (`compression.wrap`), the embedding's by
    the exchange of touched rows (`mean`)."""
    if active(spec):
        parts.set("reduce", lambda grads_fn, placement: compression.wrap(
            grads_fn, placement, mean=mean(spec)), by=NAME)


def mean(spec, key: str = "embed"):
    """(weighted local gradients, state, local batch) -> (mean gradients, state), inside
    `shard_map` over dp: `strategies.compression.wrap`'s `mean` for this plan."""
    import jax
    import jax.numpy as jnp

    from jaxscale.strategies.compression.methods import invariant_all_gather
    n, R = spec.deg("dp"), rows(spec)

    def fn(grads, state, batch):
        table_VD = grads[key]
        V = table_VD.shape[0]
        others = {k: v for k, v in grads.items() if k != key}
        others = jax.tree.map(lambda g: g / n, jax.lax.psum(others, "dp"))
        ids_R = jnp.unique(batch["inputs"].reshape(-1), size=R, fill_value=V).astype(jnp.int32)
        rows_RD = table_VD.at[ids_R].get(mode="fill", fill_value=0).astype(jnp.float32)
        all_ids = invariant_all_gather(ids_R, "dp")              # [N R]
        all_rows = invariant_all_gather(rows_RD, "dp")           # [N R, D]
        dense_VD = jnp.zeros(table_VD.shape, jnp.float32).at[all_ids].add(all_rows, mode="drop")
        return {**others, key: (dense_VD / n).astype(table_VD.dtype)}, state
    return fn
