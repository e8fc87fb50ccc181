"""Ring and all-gather attention over a sequence-sharded mesh axis, per shard, with custom VJPs.

Each shard holds q [B, Tl, H, D], k/v [B, Tl, K, D] (Tl = T/sp) in a sequence layout
(`seq_layout.py`); `ring_attention` passes the K/V blocks around the ring, `allgather_attention`
gathers them once, and both then run the same hops (`context.py` counts their collectives and
wraps them in `shard_map`). Memory: saved for the backward are q, k, v, o and the log-sum-exp
only (the all-gather also the gathered K/V); a ring hop holds two K/V blocks (the permute of hop
s+1 is issued before hop s computes, so the two can overlap; XLA's scheduler decides).

Ring and all-gather visit the kv shards in one order: hop s brings shard (r - s) mod sp to shard
r. Hop 0 is the own block (causal on local indices: both layouts keep a shard's tokens in true
order); a later hop computes one dense (query range x key range) pair, chosen by `lax.cond` on
whether the visiting shard comes before (src < r) or after this one (`hop_pairs`): contiguous
runs all x all or nothing, zig-zag all queries x the first kv chunk or the second query chunk x
all keys. No pair needs a position offset, so the inner block is a plain kernel: `xla` (one tile,
`online_softmax_step`/`block_grads` of `blockwise.py`), `blockwise` (tiled, skips masked tiles)
or `pallas` (the FlashAttention kernels; `auto` picks it on a CUDA GPU). Hops merge through their
log-sum-exp; the backward recomputes each hop from the final o and log-sum-exp.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxscale.axes import permute
from jaxscale.hooks.attention import _on_cuda_gpu, choose
from jaxscale.kernels import blockwise as bw
from jaxscale.kernels import flash_attention as fa
from jaxscale.kernels import flash_backward as fb
from jaxscale.kernels import flash_forward as ff
from jaxscale.kernels import flash_tuning as ft
from jaxscale.kernels.blockwise import (
    MASK_VALUE,
    block_grads,
    check_inputs,
    finalize,
    init_carry,
    online_softmax_step,
    pad_to,
)
from jaxscale.kernels.tiles import tile_mask
from jaxscale.strategies.sp.seq_layout import check_layout, hop_pairs

#: inner block implementations of ring / all-gather (cuDNN's public call returns no log-sum-exp)
HOP_IMPLEMENTATIONS = ("auto", "xla", "blockwise", "pallas")
F32 = jnp.float32


# ----------------------------------------------------------------------------- inner block
@dataclasses.dataclass(frozen=True)
class _Cfg:
    axis_name: str
    sp: int
    causal: bool
    layout: str
    impl: str            # xla | blockwise | pallas
    scale: float
    block_q: int
    block_k: int

    def pairs(self, Tl: int):
        return hop_pairs(Tl, self.layout, self.causal)


def _hop_impl(implementation: str, Tl: int) -> str:
    if implementation not in HOP_IMPLEMENTATIONS:
        extra = (" (cuDNN's attention call returns no log-sum-exp to merge hops with: use 'pallas'"
                 " on a GPU, or method='ulysses')" if implementation == "cudnn" else "")
        raise ValueError(f"ring / all-gather attention runs its blocks on one of "
                         f"{', '.join(HOP_IMPLEMENTATIONS)}; got {implementation!r}{extra}")
    return choose(implementation, Tl, Tl, gpu=_on_cuda_gpu(), cudnn=False)


def _flash_cfg(cfg: _Cfg, causal, T, S, D, dtype, has_seg):
    """The Pallas kernels' static config for one pair, as `flash_attention` builds it (tiles from
    its tuning table where it has one), and the padded lengths (Tp, Sp, Dp)."""
    fields = {f.name for f in dataclasses.fields(ff._Cfg)}
    if "tuning" in fields:
        tuning = ft.resolve_tuning(D, causal, dtype)
        blocks = tuning.block_sizes().fit(T, S, None)
        extra = {"tuning": tuning.with_blocks(blocks)}
    else:
        blocks = ft.BlockSizes().fit(T, S, None)
        extra = {"blocks": blocks, "num_warps": None, "num_stages": None}
    c = ff._Cfg(T=T, S=S, causal=causal, window=None, q_offset=0, scale=cfg.scale,
                block_mask=None, has_seg=has_seg, interpret=fa.default_interpret(),
                precision=None, **extra)
    q_unit = max(blocks.block_q, blocks.block_q_dq, blocks.block_q_dkv)
    k_unit = max(blocks.block_k, blocks.block_k_dq, blocks.block_k_dkv)
    Dp = max(16, 1 << (D - 1).bit_length())        # head_dim padded to a power of two
    return c, -(-T // q_unit) * q_unit, -(-S // k_unit) * k_unit, Dp


def _blockwise_static(cfg: _Cfg, causal, T, S):
    bq, bk = min(cfg.block_q, -(-T // 8) * 8), min(cfg.block_k, -(-S // 8) * 8)
    st = bw._Static(T, S, bq, bk, causal, None, 0, cfg.scale, None)
    return st, -(-T // bq) * bq, -(-S // bk) * bk


def _pad_seg(qseg, kseg, Tp, Sp):
    if qseg is None:
        return None, None
    return pad_to(qseg.astype(jnp.int32), Tp, 1, -1), pad_to(kseg.astype(jnp.int32), Sp, 1, -2)


def _xla_mask(causal, T, S, qseg, kseg):
    if not causal and qseg is None:
        return None
    return tile_mask(jnp.arange(T), jnp.arange(S), causal=causal, q_segment_ids=qseg,
                     kv_segment_ids=kseg)


def _inner_fwd(cfg: _Cfg, causal, q, k, v, qseg, kseg):
    """(o [B,T,H,D] fp32, lse [B,H,T] natural log) of q against k/v with local-index masking."""
    B, T, H, D = q.shape
    S = k.shape[1]
    if cfg.impl == "xla":   # one tile: scores [B, H, T, S] materialised
        mask = _xla_mask(causal, T, S, qseg, kseg)
        carry = online_softmax_step(q, k, v, init_carry(q, k.shape[2]), scale=cfg.scale, mask=mask)
        return finalize(carry)
    if cfg.impl == "blockwise":
        st, Tp, Sp = _blockwise_static(cfg, causal, T, S)
        qs, ks = _pad_seg(qseg, kseg, Tp, Sp)
        o, lse = bw._forward(st, pad_to(q, Tp, 1), pad_to(k, Sp, 1), pad_to(v, Sp, 1), qs, ks)
        return o[:, :T].astype(F32), lse[..., :T]
    c, Tp, Sp, Dp = _flash_cfg(cfg, causal, T, S, D, q.dtype, qseg is not None)
    qs, ks = _pad_seg(qseg, kseg, Tp, Sp)
    pad = lambda x, n: pad_to(pad_to(x, n, 1), Dp, 3)  # noqa: E731
    o, lse2 = ff._forward(c, pad(q, Tp), pad(k, Sp), pad(v, Sp), qs, ks)
    return o[:, :T, :, :D].astype(F32), lse2[..., :T] / ff.LOG2E     # base-2 -> natural


def _inner_bwd(cfg: _Cfg, causal, q, k, v, qseg, kseg, o, lse, do):
    """(dq, dk, dv) fp32 of one pair from the final (merged) o and log-sum-exp."""
    B, T, H, D = q.shape
    S = k.shape[1]
    if cfg.impl == "xla":
        mask = _xla_mask(causal, T, S, qseg, kseg)
        delta = jnp.einsum("bthd,bthd->bht", o.astype(F32), do.astype(F32))
        return block_grads(q, k, v, do, lse, delta, scale=cfg.scale, mask=mask)
    if cfg.impl == "blockwise":
        st, Tp, Sp = _blockwise_static(cfg, causal, T, S)
        qs, ks = _pad_seg(qseg, kseg, Tp, Sp)
        grads = bw._backward(st, pad_to(q, Tp, 1), pad_to(k, Sp, 1), pad_to(v, Sp, 1), qs, ks,
                             pad_to(o, Tp, 1), pad_to(lse, Tp, 2), pad_to(do, Tp, 1))
        return tuple(g[:, :n].astype(F32) for g, n in zip(grads, (T, S, S)))
    c, Tp, Sp, Dp = _flash_cfg(cfg, causal, T, S, D, q.dtype, qseg is not None)
    qs, ks = _pad_seg(qseg, kseg, Tp, Sp)
    pad = lambda x, n: pad_to(pad_to(x, n, 1), Dp, 3)  # noqa: E731
    lse2 = jnp.maximum(lse * ff.LOG2E, MASK_VALUE)
    grads = fb._backward(c, pad(q, Tp), pad(k, Sp), pad(v, Sp), qs, ks, pad(o, Tp),
                         pad_to(lse2, Tp, 2), pad(do, Tp))
    return tuple(g[:, :n, :, :D].astype(F32) for g, n in zip(grads, (T, S, S)))


# ----------------------------------------------------------------------------- hops
def _merge(o, lse, o_h, lse_h):
    """Combine two partial softmax results over disjoint key sets through their log-sum-exps."""
    new = jnp.logaddexp(lse, lse_h)                                   # [B, H, T]
    w = lambda x: jnp.transpose(jnp.exp(x - new), (0, 2, 1))[..., None]  # noqa: E731
    return o * w(lse) + o_h * w(lse_h), new


def _pair_fwd(cfg, pair, q, kv, qseg, kseg, acc):
    """Fold pair `pair` of this hop into acc = (o fp32, lse) (None before the first hop)."""
    if pair is None:
        return acc
    qs, ks = slice(pair.q0, pair.q1), slice(pair.k0, pair.k1)
    o_h, lse_h = _inner_fwd(cfg, pair.causal, q[:, qs], kv[0][:, ks], kv[1][:, ks],
                            None if qseg is None else qseg[:, qs],
                            None if kseg is None else kseg[:, ks])
    if acc is None:
        return o_h, lse_h      # hop 0 covers every query row
    o, lse = acc
    o_m, lse_m = _merge(o[:, qs], lse[..., qs], o_h, lse_h)
    return o.at[:, qs].set(o_m), lse.at[..., qs].set(lse_m)


def _pair_bwd(cfg, pair, q, kv, qseg, kseg, o, lse, do):
    """(dq [B,Tl,H,D], dkv [2,B,Tl,K,D]) fp32 of one hop's pair, zeros outside it."""
    dq = jnp.zeros(q.shape, F32)
    dkv = jnp.zeros(kv.shape, F32)
    if pair is None:
        return dq, dkv
    qs, ks = slice(pair.q0, pair.q1), slice(pair.k0, pair.k1)
    dq_h, dk_h, dv_h = _inner_bwd(cfg, pair.causal, q[:, qs], kv[0][:, ks], kv[1][:, ks],
                                  None if qseg is None else qseg[:, qs],
                                  None if kseg is None else kseg[:, ks],
                                  o[:, qs], lse[..., qs], do[:, qs])
    return dq.at[:, qs].set(dq_h), dkv.at[:, :, ks].set(jnp.stack([dk_h, dv_h]))


def _hop(cfg, s, r, fn, *args):
    """fn(cfg, pair, *args) for hop s on shard r: the own block at s = 0, else the pair of a
    visiting shard src = (r - s) mod sp, chosen by a cond on src < r (i.e. r >= s)."""
    own, before, after = cfg.pairs(args[0].shape[1])
    if s == 0:
        return fn(cfg, own, *args)
    if before == after:
        return fn(cfg, before, *args)
    return lax.cond(r >= s, lambda: fn(cfg, before, *args), lambda: fn(cfg, after, *args))


def _kseg_of(kseg_all, src):
    return None if kseg_all is None else lax.dynamic_index_in_dim(kseg_all, src, 0, False)


def _shard_index(cfg, x):
    """This shard's place on the ring, tied to the data `x` (adding 0 computed from it): an index
    computed from nothing is hoisted by partial evaluation into a shard_map of its own, without
    operands, when the attention sits in `lax.scan` under `grad`, and Shardy refuses that."""
    return lax.axis_index(cfg.axis_name) + jnp.isnan(x.ravel()[0]).astype(jnp.int32) * 0


# ----------------------------------------------------------------------------- ring
def _rotate(cfg, x):
    """Shard i sends x to shard i+1 (one collective-permute)."""
    return permute(x, cfg.axis_name, [(i, (i + 1) % cfg.sp) for i in range(cfg.sp)])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(cfg, q, k, v, qseg, kseg_all):
    return _ring_fwd(cfg, q, k, v, qseg, kseg_all)[0]


def _ring_fwd(cfg, q, k, v, qseg, kseg_all):
    r = _shard_index(cfg, q)
    kv = jnp.stack([k, v])                                   # [2, B, Tl, K, D]: one permute a hop
    acc = None
    for s in range(cfg.sp):
        nxt = _rotate(cfg, kv) if s + 1 < cfg.sp else None   # in flight while hop s computes
        acc = _hop(cfg, s, r, _pair_fwd, q, kv, qseg, _kseg_of(kseg_all, (r - s) % cfg.sp), acc)
        kv = nxt
    o = acc[0].astype(q.dtype)
    return o, (q, k, v, qseg, kseg_all, o, acc[1])


def _ring_bwd(cfg, res, do):
    q, k, v, qseg, kseg_all, o, lse = res
    r = _shard_index(cfg, q)
    # [v, k], not the forward's [k, v]: XLA would merge identical permutes of identical blocks
    # (CSE), keeping every rotated block alive from the forward to the backward. The barrier ties
    # the rotation to dO where the scheduler honours barriers (XLA:CPU drops them).
    vk, do = lax.optimization_barrier((jnp.stack([v, k]), do))
    dq, own, travel = jnp.zeros(q.shape, F32), None, None
    for s in range(cfg.sp):
        nxt = _rotate(cfg, vk) if s + 1 < cfg.sp else None
        if s >= 2:   # the accumulator of the visiting block follows it (it started at hop 1)
            travel = _rotate(cfg, travel)
        dq_h, dkv_h = _hop(cfg, s, r, _pair_bwd, q, vk[::-1], qseg,
                           _kseg_of(kseg_all, (r - s) % cfg.sp), o, lse, do)
        dq = dq + dq_h
        if s == 0:
            own = dkv_h
        else:
            travel = dkv_h if travel is None else travel + dkv_h
        vk = nxt
    if travel is not None:   # after hop sp-1 shard r holds block r+1's sum: one hop home
        own = own + _rotate(cfg, travel)
    return dq.astype(q.dtype), own[0].astype(k.dtype), own[1].astype(v.dtype), None, None


_ring.defvjp(_ring_fwd, _ring_bwd)


# ----------------------------------------------------------------------------- all-gather
@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gathered(cfg, q, kv_all, qseg, kseg_all):
    return _gathered_fwd(cfg, q, kv_all, qseg, kseg_all)[0]


def _gathered_fwd(cfg, q, kv_all, qseg, kseg_all):
    r = _shard_index(cfg, q)
    acc = None
    for s in range(cfg.sp):
        src = (r - s) % cfg.sp
        kv = lax.dynamic_index_in_dim(kv_all, src, 0, False)
        acc = _hop(cfg, s, r, _pair_fwd, q, kv, qseg, _kseg_of(kseg_all, src), acc)
    o = acc[0].astype(q.dtype)
    return o, (q, kv_all, qseg, kseg_all, o, acc[1])


def _gathered_bwd(cfg, res, do):
    q, kv_all, qseg, kseg_all, o, lse = res
    r = _shard_index(cfg, q)
    dq, dkv_all = jnp.zeros(q.shape, F32), jnp.zeros(kv_all.shape, F32)
    for s in range(cfg.sp):
        src = (r - s) % cfg.sp
        kv = lax.dynamic_index_in_dim(kv_all, src, 0, False)
        dq_h, dkv_h = _hop(cfg, s, r, _pair_bwd, q, kv, qseg, _kseg_of(kseg_all, src), o, lse, do)
        dq = dq + dq_h
        dkv_all = lax.dynamic_update_index_in_dim(
            dkv_all, lax.dynamic_index_in_dim(dkv_all, src, 0, False) + dkv_h, src, 0)
    return dq.astype(q.dtype), dkv_all.astype(kv_all.dtype), None, None


_gathered.defvjp(_gathered_fwd, _gathered_bwd)


# ----------------------------------------------------------------------------- per-shard API
def _setup(q, k, v, segment_ids, axis_name, causal, layout, implementation, block_q, block_k):
    check_inputs(q, k, v, segment_ids, None, None)
    sp = lax.axis_size(axis_name)
    Tl = q.shape[1]
    if k.shape[1] != Tl:
        raise ValueError(f"context attention needs q and k/v shards of one length, got "
                         f"{Tl} and {k.shape[1]}")
    check_layout(Tl * sp, sp, layout)
    cfg = _Cfg(axis_name, sp, bool(causal), layout, _hop_impl(implementation, Tl),
               q.shape[-1] ** -0.5, block_q, block_k)
    kseg_all = None if segment_ids is None else lax.all_gather(segment_ids, axis_name)
    return cfg, kseg_all


def ring_attention(q, k, v, *, axis_name: str = "sp", causal: bool = True, segment_ids=None,
                   layout: str = "zigzag", implementation: str = "auto",
                   block_q: int = 512, block_k: int = 512):
    """Ring attention on this shard (inside shard_map over `axis_name`): q [B,Tl,H,D], k/v
    [B,Tl,K,D], segment ids [B,Tl], tokens in `layout` -> o [B,Tl,H,D]. Custom VJP."""
    cfg, kseg_all = _setup(q, k, v, segment_ids, axis_name, causal, layout, implementation,
                           block_q, block_k)
    return _ring(cfg, q, k, v, segment_ids, kseg_all)


def allgather_attention(q, k, v, *, axis_name: str = "sp", causal: bool = True, segment_ids=None,
                        layout: str = "zigzag", implementation: str = "auto",
                        block_q: int = 512, block_k: int = 512):
    """All-gather K/V, then the ring's hops read from the gathered copy; the backward
    reduce-scatters dK/dV. Same arguments as `ring_attention`."""
    cfg, kseg_all = _setup(q, k, v, segment_ids, axis_name, causal, layout, implementation,
                           block_q, block_k)
    kv_all = lax.all_gather(jnp.stack([k, v]), axis_name)      # [sp, 2, B, Tl, K, D]
    return _gathered(cfg, q, kv_all, segment_ids, kseg_all)
