"""Sequence and context parallelism: Megatron SP over `tp`, context parallelism over `sp`.

Rules: `norm_seq` (the residual stream's sequence, between the attention and MLP regions) over
tp with `plan.sequence_parallel`, over sp (then tp) with `mesh.sp > 1`; `seq` (the attention and
MLP regions) over sp. The attention of a sequence split over sp runs in `context.py` (ring and
all-gather in `ring.py`), the method named by `plan.context`: this module registers ring, Ulysses
and all-gather attention (`context.py`) for the model's `context` seam (`jaxscale.hooks`) and
names the plan's in its rules. The ring's zig-zag layout is applied to the batch inside the step
(`batch_layout`, the step's `batch_view`).

Megatron sequence parallelism (`plan.sequence_parallel`, arXiv 2205.05198) saves the residual
stream's activation memory t-fold: the norm and residual regions are split on `seq` over tp
(`jaxscale.strategies.tables.activations.split`), at no extra cost in bytes: each TP all-reduce
becomes a reduce-scatter plus an all-gather collective of the same total (`strategies/tp`
counts them).

Context parallelism over `sp` (`plan.context`) saves activations sp-fold: every token-indexed
activation is split sp ways (the attention scores keep their full key length). Its cost is
collectives on the critical path, per layer and micro-batch:
- `ring` (Ring Attention): K/V blocks pass around the ring, (sp - 1) collective-permutes of the
  local K/V block forward, twice that backward (K/V again and their gradients);
- `ulysses` (DeepSpeed-Ulysses): all-to-alls from sequence- to head-sharded q, k, v and back for
  the output, forward and backward (per-link volume 4Nh/P); where sp does not divide the q or kv
  heads per tp rank, each sp shard gets ceil(heads/sp) q slots (zero heads past the last) and
  the kv heads they read, the all-to-alls carrying the slots (`heads.py`);
- `allgather`: K/V all-gathered forward, their gradients reduce-scattered backward.
The weight gradients are reduced over sp as over a data axis (`strategies/dp`).
"""
from __future__ import annotations

from jaxscale.hooks import register
from jaxscale.strategies.common import Comm, Term, permutes
from jaxscale.strategies.remat import actions
from jaxscale.strategies.sp.heads import exchanged_heads
from jaxscale.strategies.tables.activations import tokens_split

NAME = "sp"
AVAILABLE = True
CONTEXTS = ("ring", "ulysses", "allgather")


def active(spec) -> bool:
    return spec.deg("sp") > 1 or spec.sequence_parallel


def problems(spec) -> list[str]:
    sp, t, errs = spec.deg("sp"), spec.deg("tp"), []
    if sp > 1:
        if spec.seq % (2 * sp):
            errs.append(f"context parallelism cuts data.seq_len={spec.seq} into 2 x mesh.sp = "
                        f"{2 * sp} zig-zag chunks: use a multiple of {2 * sp}")
        if spec.context not in CONTEXTS:
            errs.append(f"plan.context={spec.context!r}: valid are {', '.join(CONTEXTS)}")
    if spec.sequence_parallel and t == 1:
        errs.append("plan.sequence_parallel=true splits the residual stream over mesh.tp, but "
                    "mesh.tp=1: set mesh.tp > 1, or use mesh.sp for context parallelism")
    elif spec.sequence_parallel and (spec.seq // sp) % t:
        errs.append(f"Megatron sequence parallelism splits data.seq_len={spec.seq} "
                    f"(/ mesh.sp={sp}) over mesh.tp={t}: it must divide")
    return errs


def rules(spec, rules) -> None:
    norm = tokens_split(spec)        # the residual stream: over sp, then tp (Megatron SP)
    if norm:
        rules.add("norm_seq", norm, by="sp")
    if spec.deg("sp") > 1:
        rules.add("seq", "sp", by="sp")
        rules.set_seam("context", spec.context, by=NAME)


def batch_layout(spec):
    """None without context parallelism; else the step's view of a batch: every [B, T] array
    permuted into the zig-zag layout (shard r holds chunks r and 2sp-1-r of 2sp: equal causal
    work), plus `positions`, the true position of each token (RoPE). Permuting the batch before
    it is split over sp moves no data: the step receives it whole along the sequence
    (`shape_step`) and each device keeps its chunks."""
    if spec.deg("sp") == 1:
        return None
    import jax.numpy as jnp

    from jaxscale.strategies.sp.seq_layout import layout_permutation
    perm = layout_permutation(spec.seq, spec.deg("sp"))

    def apply(batch: dict) -> dict:
        out = {key: x[:, perm] for key, x in batch.items()}     # packed positions: permuted
        if "positions" not in out:
            out["positions"] = jnp.broadcast_to(jnp.asarray(perm, jnp.int32), out["inputs"].shape)
        return out
    return apply


def shape_step(spec, parts) -> None:
    """The step: the batch seen through the zig-zag layout (`batch_layout`) before the loss, and
    received whole along the sequence (each device keeps its chunks once it is permuted)."""
    if spec.deg("sp") > 1:
        parts.set("batch_view", batch_layout(spec), by=NAME)
        parts.set("batch_seq", None, by=NAME)


def _context(method: str):
    """The model's attention over sequence shards by `method` (`context.context_attention`)."""
    def run(q, k, v, *, mesh, rules, **kw):
        from jaxscale.strategies.sp.context import context_attention
        return context_attention(q, k, v, method=method, mesh=mesh, rules=rules, **kw)
    return run


for _method in CONTEXTS:
    register("context", _method)(_context(_method))


def collectives(spec) -> list[Comm]:
    sp = spec.deg("sp")
    if sp == 1:
        return []
    m, k, t = spec.model, max(1, spec.accumulate), spec.deg("tp")
    L = spec.layers_per_device
    tokens = spec.micro_batch * spec.local_seq
    beta = spec.wire_compute_itemsize
    kv = 2 * tokens * m.n_kv_heads * m.hd / t * beta          # the local K and V blocks
    # a remat policy that recomputes the attention replays its forward collectives
    replay = 1 if actions(spec.remat)["attn_out"] == "remat" else 0
    again = " (and the forward's again for the rematerialised attention)" if replay else ""
    if spec.context == "ring":     # K/V forward and again backward; the dK/dV travel in fp32
        hops = (sp - 1) * L * k
        return [permutes(spec, "sp", kv * (2 + replay) * hops + kv / beta * 4 * hops,
                         int((3 + replay) * hops), "ring attention: K/V blocks forward, K/V and "
                         "fp32 dK/dV backward" + again)]
    if spec.context == "allgather":
        return [Comm("all-gather", ("sp",), kv * sp * L * k * (1 + replay),
                     int(L * k * (1 + replay)), "K/V gathered over the sequence, forward" + again,
                     group=sp),
                Comm("reduce-scatter", ("sp",), kv * sp * L * k, int(L * k),
                     "dK/dV reduced to their sequence shards, backward", group=sp)]
    H, K = m.n_heads // t, m.n_kv_heads // t
    nq, nk = exchanged_heads(H, K, sp)          # head slots, padded where sp does not divide
    rq, rk = exchanged_heads(H, K, sp, real=True)     # the slots holding a head (`heads.py`)
    per = tokens * m.hd * beta * (2 + replay) * L * k
    pad = ("" if (nq, nk) == (H, K) else
           f" ({nq} q and {nk} kv head slots for {H} and {K} heads: zero heads, and kv heads "
           f"sent to each shard whose q heads read them, where sp does not divide them)")
    return [Comm("all-to-all", ("sp",), (2 * nq + 2 * nk) * per, int((8 + 4 * replay) * L * k),
                 "Ulysses: q, k, v, out forward and backward" + again + pad, group=sp,
                 minimum=(2 * rq + 2 * rk) * per)]


def head_padding(spec) -> float:
    """The attention's heads computed per real head: Ulysses' q slots over the q heads of a tp
    rank (zero heads where sp does not divide them, `heads.py`), else 1."""
    if spec.deg("sp") == 1 or spec.context != "ulysses":
        return 1.0
    t = spec.deg("tp")
    H = spec.model.n_heads // t
    return exchanged_heads(H, spec.model.n_kv_heads // t, spec.deg("sp"))[0] / H


def memory(spec) -> list[Term]:
    """The activation split is in the per-layer table (`activations.split`); here the attention's
    fp32 backward tiles ([micro-batch, heads, b, b], b = min(512, keys)). Ulysses: 4 of them over
    the whole sequence on its heads / sp, when the inner attention is blockwise. Ring and
    all-gather visit one pair of sequence shards per hop, unrolled: XLA:CPU keeps 2 tiles of
    each of the sp hops until their gradients merge (read from its buffer assignments; on a GPU
    the hop is the Pallas kernel, tiles on chip)."""
    sp = spec.deg("sp")
    if sp == 1:
        return []
    heads = spec.model.n_heads / spec.deg("tp")
    if spec.context == "ulysses":
        if spec.attention != "blockwise":
            return []
        t = spec.deg("tp")
        b, tiles = min(512, spec.seq), 4
        heads = exchanged_heads(spec.model.n_heads // t, spec.model.n_kv_heads // t, sp)[0] / sp
    elif spec.device_kind == "cpu" or spec.attention == "blockwise":
        b, tiles = min(512, spec.local_seq), 2 * sp
    else:
        return []
    return [Term("backward", tiles * spec.micro_batch * heads * b * b * 4,
                 "context-parallel attention's backward tiles")]


def label(spec) -> list[str]:
    out = [spec.context] if spec.deg("sp") > 1 else []
    return out + (["megatron-sp"] if spec.sequence_parallel else [])
