"""Context-parallel attention over a sequence-sharded mesh axis (`sp`): ring, Ulysses, all-gather.

Each device holds a slice of the sequence: q [B, T/sp, H, D], k/v [B, T/sp, K, D], segment ids
[B, T/sp]. All three methods compute exactly full attention (fp32 softmax, GQA without repeating
K/V, rows with no allowed key give zeros, as `reference.py`); they differ in what moves. This
module holds their collective counts, Ulysses and the global wrapper `context_attention`; ring and
all-gather attention are in `ring.py`.

Collectives per call (one layer), as `collective_counts` states them and the compiled HLO shows
them (the tests count both). "K/V block" = the local k and v stacked, 2·B·(T/sp)·K·D items:
- `ring` (Ring Attention): forward (sp-1) collective-permutes of the K/V block; backward (sp-1)
  of the K/V block again plus (sp-1) of the dK/dV accumulator (fp32), which travels with the
  block it belongs to and goes home after its last hop: 3(sp-1) in all (`ring.py`).
- `ulysses` (DeepSpeed-Ulysses): forward 4 all-to-alls (q, k and v from sequence- to
  head-sharded, the output back), backward 4 (their transposes). The attention in between is
  ordinary full-sequence attention on H/sp heads (any implementation, cuDNN included); q, k, v, o
  keep their per-device size, and the volume per device stays constant when T and sp grow
  together. Where sp does not divide the local q or kv heads, each shard receives ceil(H/sp)
  q slots (zero heads past H) and the kv heads they read (a kv head two shards' q heads share
  goes to both): the all-to-alls carry the slots, not the heads (`heads.py`).
- `allgather`: forward one all-gather of the K/V block, backward one reduce-scatter of dK/dV.
  The simple baseline: every device holds, and saves for the backward, the whole K/V.
With packed segment ids every method adds one all-gather of the [B, T] int32 ids, forward.

Layouts. Causal attention on contiguous shards is unbalanced: shard r attends to r whole blocks
plus its diagonal one, and the step waits for the last shard. The zig-zag layout cuts the
sequence into 2·sp chunks and gives shard r chunks r and 2sp-1-r: every shard does the same work
(`ring_work` counts the tiles). A layout is a permutation of the tokens applied once at the data
side (`to_layout` on tokens, targets, loss mask, positions and segment ids; `from_layout` undoes
it; all in `seq_layout.py`); attention knows the true positions from the layout
(`layout_positions`). Zig-zag needs T divisible by 2·sp (else a ValueError: pad, or use
layout='contiguous', which needs sp | T).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxscale.axes import active, suspended
from jaxscale.hooks.attention import attention, resolve
from jaxscale.kernels import blockwise as bw
from jaxscale.kernels import flash_attention as fa
from jaxscale.kernels.blockwise import check_inputs
from jaxscale.strategies.sp.heads import ulysses_slots
from jaxscale.strategies.sp.ring import allgather_attention, ring_attention
from jaxscale.strategies.sp.seq_layout import check_layout, from_layout, to_layout

METHODS = ("ring", "ulysses", "allgather")


def collective_counts(method: str, sp: int, *, segment_ids: bool = False) -> dict:
    """{'forward': {kind: n}, 'backward': {kind: n}} of one call, as the compiled HLO shows them."""
    if method not in METHODS:
        raise ValueError(f"unknown context-parallel method {method!r}; valid: {', '.join(METHODS)}")
    if sp == 1:
        return {"forward": {}, "backward": {}}
    fwd, bwd = {
        "ring": ({"collective-permute": sp - 1}, {"collective-permute": 2 * (sp - 1)}),
        "ulysses": ({"all-to-all": 4}, {"all-to-all": 4}),
        "allgather": ({"all-gather": 1}, {"reduce-scatter": 1}),
    }[method]
    if segment_ids:
        fwd = {**fwd, "all-gather": fwd.get("all-gather", 0) + 1}
    return {"forward": fwd, "backward": bwd}


# ----------------------------------------------------------------------------- Ulysses
def _full_attention(q, k, v, *, causal, segment_ids, implementation, block_q, block_k):
    """Whole-sequence attention on one device (no sharding rules consulted: `attention()`'s pallas
    path would open a shard_map inside this one, so Pallas is called directly)."""
    impl = resolve(implementation, q, k, causal=causal, segment_ids=segment_ids)
    if impl == "blockwise":
        return bw.blockwise_attention(q, k, v, causal=causal, segment_ids=segment_ids,
                                      block_q=block_q, block_k=block_k)
    if impl == "cudnn":
        try:
            return attention(q, k, v, causal=causal, segment_ids=segment_ids,
                             implementation="cudnn")
        except (NotImplementedError, ValueError, RuntimeError):
            if implementation != "auto":
                raise
            impl = "pallas"     # as attention()'s 'auto': pallas when cuDNN refuses
    if impl == "pallas":
        return fa.flash_attention(q, k, v, causal=causal, segment_ids=segment_ids)
    return attention(q, k, v, causal=causal, segment_ids=segment_ids, implementation=impl)


def ulysses_attention(q, k, v, *, axis_name: str = "sp", causal: bool = True, segment_ids=None,
                      layout: str = "zigzag", implementation: str = "auto",
                      block_q: int = 512, block_k: int = 512):
    """Ulysses on this shard: all-to-all to head-sharded full sequences, attention, and back.
    Any head counts: heads that sp does not divide are padded with zero heads (`heads.py`).
    `implementation` is any of `jaxscale.hooks.attention`'s (cuDNN included)."""
    check_inputs(q, k, v, segment_ids, None, None)
    sp = lax.axis_size(axis_name)
    slots = ulysses_slots(q.shape[2], k.shape[2], sp)
    T = q.shape[1] * sp
    check_layout(T, sp, layout)
    if slots.padded:           # [B, T/sp, sp nq | sp nk, D]: each shard's slots in turn
        q, k, v = _slots(q, slots.q_send), _slots(k, slots.kv_send), _slots(v, slots.kv_send)
    to_heads = lambda x: lax.all_to_all(x, axis_name, 2, 1, tiled=True)  # noqa: E731
    q, k, v = to_heads(q), to_heads(k), to_heads(v)                       # [B, T, nq | nk, D]
    seg = (None if segment_ids is None else
           lax.all_gather(segment_ids, axis_name, axis=1, tiled=True))    # [B, T]
    reorder = causal and layout != "contiguous"   # causal needs true order; other masks do not
    if reorder:
        q, k, v = (from_layout(x, sp, 1, layout) for x in (q, k, v))
        seg = None if seg is None else from_layout(seg, sp, 1, layout)
    o = _full_attention(q, k, v, causal=causal, segment_ids=seg, implementation=implementation,
                        block_q=block_q, block_k=block_k)
    if reorder:
        o = to_layout(o, sp, 1, layout)
    o = lax.all_to_all(o, axis_name, 1, 2, tiled=True)                    # [B, T/sp, sp nq, D]
    return o[:, :, list(slots.q_back)] if slots.padded else o


def _slots(x, heads):
    """x [B, T, n, D] as the heads `heads` (-1: a zero head) along axis 2."""
    if -1 in heads:
        x = jnp.concatenate([x, jnp.zeros_like(x[:, :, :1])], axis=2)
    return x[:, :, [h if h >= 0 else x.shape[2] - 1 for h in heads]]


PER_SHARD = {"ring": ring_attention, "ulysses": ulysses_attention,
             "allgather": allgather_attention}


# ----------------------------------------------------------------------------- global wrapper
def _specs(mesh, seq_axis, batch_axes, head_axes, rules, K):
    if rules is not None:
        q_spec = rules.spec(("batch", "seq", "heads", None))
        kv_spec = rules.spec(("batch", "seq", "kv_heads", None))
        if q_spec[1] != seq_axis:
            raise ValueError(f"context attention shards the sequence over {seq_axis!r}, but the "
                             f"rules map logical 'seq' to {q_spec[1]!r}")
        batch_axes = q_spec[0]
        head_axes = q_spec[2] if q_spec[2] == kv_spec[2] else None   # GQA groups stay whole
    elif head_axes is not None:
        n = math.prod(mesh.shape[a] for a in ((head_axes,) if isinstance(head_axes, str)
                                              else head_axes))
        if K % n:
            raise ValueError(f"kv heads {K} are not divisible by the {n} shards of head axes "
                             f"{head_axes}: GQA groups would straddle devices; pass head_axes=None")
    return P(batch_axes, seq_axis, head_axes, None), P(batch_axes, seq_axis)


def context_attention(q, k, v, *, method: str = "ring", mesh=None, seq_axis: str = "sp",
                      batch_axes=None, head_axes=None, rules=None, causal: bool = True,
                      segment_ids=None, layout: str = "zigzag", implementation: str = "auto",
                      block_q: int = 512, block_k: int = 512):
    """Global q [B,T,H,D], k/v [B,T,K,D] (tokens already in `layout`) -> o [B,T,H,D], computed
    sequence-sharded over mesh axis `seq_axis` by `method` inside `jax.shard_map`.

    Batch and heads are sharded over `batch_axes` / `head_axes` (mesh axis names), or, given
    `rules` (a `jaxscale.axes.Rules`), over the axes of logical `batch` and `heads`/`kv_heads`
    (heads whole when query and kv heads map differently). Without `mesh`, the mesh and rules of
    `jaxscale.axes.use_rules` are used, as the model's attention call sees them.
    """
    if method not in METHODS:
        raise ValueError(f"unknown context-parallel method {method!r}; valid: {', '.join(METHODS)}")
    if mesh is None:
        ctx = active()
        if ctx is None:
            raise ValueError("context_attention needs a mesh: pass mesh=, or call it under "
                             "jaxscale.axes.use_rules(mesh, rules)")
        mesh, rules = ctx[0], rules if rules is not None else ctx[1]
    if seq_axis not in mesh.axis_names:
        raise ValueError(f"mesh axes {mesh.axis_names} have no {seq_axis!r} to shard the sequence")
    check_inputs(q, k, v, segment_ids, None, None)
    check_layout(q.shape[1], mesh.shape[seq_axis], layout)
    x_spec, seg_spec = _specs(mesh, seq_axis, batch_axes, head_axes, rules, k.shape[2])
    per_shard = functools.partial(PER_SHARD[method], axis_name=seq_axis, causal=causal,
                                  layout=layout, implementation=implementation, block_q=block_q,
                                  block_k=block_k)

    def fn(q, k, v, segment_ids=None):
        with suspended():           # shards inside: the model's global rules do not apply
            return per_shard(q, k, v, segment_ids=segment_ids)
    if segment_ids is None:
        body, specs, args = fn, (x_spec,) * 3, (q, k, v)
    else:
        body, specs, args = fn, (x_spec,) * 3 + (seg_spec,), (q, k, v, segment_ids)
    return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=x_spec,
                         check_vma=False)(*args)
