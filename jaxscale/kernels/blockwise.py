"""Memory-efficient attention in plain jnp: tiles, online softmax, a backward that recomputes.

Queries are cut into blocks of `block_q` rows and keys/values into blocks of `block_k`; a loop over
query blocks runs an inner loop over only the key/value blocks that the mask lets the block see
(causal, sliding window and block-sparse masks skip whole tiles; the static `TileMap` of
`tiles.py` lists them). Each visited tile does one online-softmax step on running (max m, sum l,
accumulator acc), so no [T, S] score matrix exists: live memory is O(B·H·block_q·block_k) per step
plus the O(B·T·H·D) inputs and outputs, i.e. linear in sequence length (the xla reference is
quadratic). The backward (a `jax.custom_vjp`) saves only q, k, v, the output and the log-sum-exp
per row, and recomputes the probabilities tile by tile (FlashAttention-2 style): one more pass of
QK^T FLOPs buys not storing the O(T·S) probabilities. The loops run on any backend; they are the
portable fallback of the Pallas kernel (`flash_attention.py`, which shares the tile map) and the
building blocks of ring attention (`online_softmax_step`, `finalize`, `block_grads`).

Shapes: q [B, T, H, D], k and v [B, S, K, D], H a multiple of K (grouped-query / multi-query
attention: a query head h reads key/value head h // (H/K); K/V are never repeated in memory).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxscale.kernels.tiles import BlockSparseMask, TileMap, tile_map, tile_mask

#: Finite stand-in for -inf in masked scores (keeps exp(m_old - m_new) and max() free of NaN).
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


# ----------------------------------------------------------------------------- per-tile steps
def init_carry(q_BTHD, num_kv_heads: int):
    """Empty running state (m, row_sum, acc) for queries q: m, row_sum [B, K, G, T];
    acc [B, K, G, T, D] fp32."""
    B, T, H, D = q_BTHD.shape
    G = H // num_kv_heads
    m = jnp.full((B, num_kv_heads, G, T), MASK_VALUE, jnp.float32)
    return m, jnp.zeros_like(m), jnp.zeros((B, num_kv_heads, G, T, D), jnp.float32)


def online_softmax_step(q_BTHD, k_BSKD, v_BSKD, carry, *, scale: float, mask=None):
    """Fold one key/value block into the running (m, row_sum, acc) of queries q.
    mask [B or 1, T, S]."""
    B, T, H, D = q_BTHD.shape
    K = k_BSKD.shape[2]
    m, row_sum, acc = carry
    q_BTKGD = q_BTHD.reshape(B, T, K, H // K, D)
    s_BKGTS = jnp.einsum("btkgd,bskd->bkgts", q_BTKGD, k_BSKD,
                         preferred_element_type=jnp.float32) * scale
    if mask is not None:
        s_BKGTS = jnp.where(mask[:, None, None], s_BKGTS, MASK_VALUE)
    m_new = jnp.maximum(m, s_BKGTS.max(-1))
    p_BKGTS = jnp.exp(s_BKGTS - m_new[..., None])
    if mask is not None:
        p_BKGTS = jnp.where(mask[:, None, None], p_BKGTS, 0.0)
    alpha = jnp.exp(m - m_new)
    row_sum = alpha * row_sum + p_BKGTS.sum(-1)
    pv_BKGTD = jnp.einsum("bkgts,bskd->bkgtd", p_BKGTS.astype(v_BSKD.dtype), v_BSKD,
                          preferred_element_type=jnp.float32)
    return m_new, row_sum, alpha[..., None] * acc + pv_BKGTD


def finalize(carry):
    """(m, row_sum, acc) -> (o [B, T, H, D] fp32, lse [B, H, T]); rows that saw no key give o = 0
    and lse = MASK_VALUE (so exp(s - lse) is never used for them: their mask is all False)."""
    m, row_sum, acc = carry
    B, K, G, T, D = acc.shape
    empty = row_sum == 0.0
    row_sum_safe = jnp.where(empty, 1.0, row_sum)
    o_BKGTD = acc / row_sum_safe[..., None]
    lse_BKGT = jnp.where(empty, MASK_VALUE, m + jnp.log(row_sum_safe))
    o_BTHD = jnp.transpose(o_BKGTD, (0, 3, 1, 2, 4)).reshape(B, T, K * G, D)
    return o_BTHD, lse_BKGT.reshape(B, K * G, T)


def block_grads(q_BTHD, k_BSKD, v_BSKD, do_BTHD, lse_BHT, delta_BHT, *, scale: float, mask=None):
    """Gradients of one (query block, key block) tile from the saved log-sum-exp.

    delta = rowsum(dO * O). Returns (dq [B,T,H,D], dk [B,S,K,D], dv [B,S,K,D]) in fp32; dk and dv
    are summed over the query heads of each group.
    """
    B, T, H, D = q_BTHD.shape
    K = k_BSKD.shape[2]
    G = H // K
    q_BTKGD = q_BTHD.reshape(B, T, K, G, D)
    do_BTKGD = do_BTHD.reshape(B, T, K, G, D)
    s_BKGTS = jnp.einsum("btkgd,bskd->bkgts", q_BTKGD, k_BSKD,
                         preferred_element_type=jnp.float32) * scale
    lse_BKGT = lse_BHT.reshape(B, K, G, T)
    p_BKGTS = jnp.exp(s_BKGTS - lse_BKGT[..., None])
    if mask is not None:
        p_BKGTS = jnp.where(mask[:, None, None], p_BKGTS, 0.0)
    dv_BSKD = jnp.einsum("bkgts,btkgd->bskd", p_BKGTS.astype(do_BTHD.dtype), do_BTKGD,
                         preferred_element_type=jnp.float32)
    dp_BKGTS = jnp.einsum("btkgd,bskd->bkgts", do_BTKGD, v_BSKD, preferred_element_type=jnp.float32)
    ds_BKGTS = (p_BKGTS * (dp_BKGTS - delta_BHT.reshape(B, K, G, T)[..., None])
                ).astype(q_BTHD.dtype)
    dq_BTKGD = jnp.einsum("bkgts,bskd->btkgd", ds_BKGTS, k_BSKD,
                          preferred_element_type=jnp.float32) * scale
    dk_BSKD = jnp.einsum("bkgts,btkgd->bskd", ds_BKGTS, q_BTKGD,
                         preferred_element_type=jnp.float32) * scale
    return dq_BTKGD.reshape(B, T, H, D), dk_BSKD, dv_BSKD


# ----------------------------------------------------------------------------- the tiled loops
@dataclass(frozen=True)
class _Static:
    T: int                  # true lengths (arrays arrive padded to whole blocks)
    S: int
    block_q: int
    block_k: int
    causal: bool
    window: int | None
    q_offset: int
    scale: float
    block_mask: BlockSparseMask | None

    def tile_map(self) -> TileMap:
        return tile_map(self.T, self.S, self.block_q, self.block_k, causal=self.causal,
                        window=self.window, q_offset=self.q_offset, block_mask=self.block_mask)

    def mask(self, i, j, qseg, kvseg):
        """Element mask of tile (query block i, key block j); segment ids are padded arrays."""
        bq, bk = self.block_q, self.block_k
        q_pos = i * bq + jnp.arange(bq)
        kv_pos = j * bk + jnp.arange(bk)
        qs = None if qseg is None else jax.lax.dynamic_slice_in_dim(qseg, i * bq, bq, 1)
        ks = None if kvseg is None else jax.lax.dynamic_slice_in_dim(kvseg, j * bk, bk, 1)
        return tile_mask(q_pos + self.q_offset, kv_pos, causal=self.causal, window=self.window,
                         kv_len=self.S, q_len=self.T + self.q_offset, q_segment_ids=qs,
                         kv_segment_ids=ks)


def _forward(st: _Static, q, k, v, qseg, kvseg):
    """Padded q [B,Tp,H,D], k/v [B,Sp,K,D] -> (o [B,Tp,H,D] in q.dtype, lse [B,H,Tp] fp32)."""
    B, Tp, H, D = q.shape
    K = k.shape[2]
    bq, bk = st.block_q, st.block_k
    sch = st.tile_map()
    nq = sch.num_q_blocks
    kv_index, kv_count = jnp.asarray(sch.kv_index), jnp.asarray(sch.kv_count)

    def q_block(_, i):
        q_blk = jax.lax.dynamic_slice_in_dim(q, i * bq, bq, 1)

        def visit(n, carry):
            j = kv_index[i, n]
            k_blk = jax.lax.dynamic_slice_in_dim(k, j * bk, bk, 1)
            v_blk = jax.lax.dynamic_slice_in_dim(v, j * bk, bk, 1)
            return online_softmax_step(q_blk, k_blk, v_blk, carry, scale=st.scale,
                                       mask=st.mask(i, j, qseg, kvseg))

        carry = jax.lax.fori_loop(0, kv_count[i], visit, init_carry(q_blk, K))
        o_blk, lse_blk = finalize(carry)
        return None, (o_blk.astype(q.dtype), lse_blk)

    _, (o_NBbHD, lse_NBHb) = jax.lax.scan(q_block, None, jnp.arange(nq))
    o_BTHD = jnp.moveaxis(o_NBbHD, 0, 1).reshape(B, Tp, H, D)
    lse_BHT = jnp.moveaxis(lse_NBHb, 0, 2).reshape(B, H, Tp)
    return o_BTHD, lse_BHT


def _backward(st: _Static, q, k, v, qseg, kvseg, o, lse_BHT, do):
    """One pass over key blocks; each visits its query blocks, dq accumulates in an fp32 carry."""
    B, Tp, H, D = q.shape
    K = k.shape[2]
    bq, bk = st.block_q, st.block_k
    sch = st.tile_map()
    q_index, q_count = jnp.asarray(sch.q_index), jnp.asarray(sch.q_count)
    delta_BHT = jnp.einsum("bthd,bthd->bht", o.astype(jnp.float32), do.astype(jnp.float32))

    def k_block(dq_BTHD, j):
        k_blk = jax.lax.dynamic_slice_in_dim(k, j * bk, bk, 1)
        v_blk = jax.lax.dynamic_slice_in_dim(v, j * bk, bk, 1)

        def visit(n, c):
            dq_acc, dk_acc, dv_acc = c
            i = q_index[j, n]
            sl = lambda x, ax: jax.lax.dynamic_slice_in_dim(x, i * bq, bq, ax)  # noqa: E731
            dq_t, dk_t, dv_t = block_grads(sl(q, 1), k_blk, v_blk, sl(do, 1), sl(lse_BHT, 2),
                                           sl(delta_BHT, 2), scale=st.scale,
                                           mask=st.mask(i, j, qseg, kvseg))
            dq_acc = jax.lax.dynamic_update_slice_in_dim(dq_acc, sl(dq_acc, 1) + dq_t, i * bq, 1)
            return dq_acc, dk_acc + dk_t, dv_acc + dv_t

        zeros = jnp.zeros((B, bk, K, D), jnp.float32)
        dq_BTHD, dk_blk, dv_blk = jax.lax.fori_loop(0, q_count[j], visit, (dq_BTHD, zeros, zeros))
        return dq_BTHD, (dk_blk.astype(k.dtype), dv_blk.astype(v.dtype))

    dq_BTHD, (dk_NBbKD, dv_NBbKD) = jax.lax.scan(
        k_block, jnp.zeros((B, Tp, H, D), jnp.float32), jnp.arange(sch.num_k_blocks))
    Sp = k.shape[1]
    dk = jnp.moveaxis(dk_NBbKD, 0, 1).reshape(B, Sp, K, D)
    dv = jnp.moveaxis(dv_NBbKD, 0, 1).reshape(B, Sp, K, D)
    return dq_BTHD.astype(q.dtype), dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention_padded(st: _Static, q, k, v, qseg, kvseg):
    return _forward(st, q, k, v, qseg, kvseg)[0]


def _attention_padded_fwd(st, q, k, v, qseg, kvseg):
    o, lse = _forward(st, q, k, v, qseg, kvseg)
    return o, (q, k, v, qseg, kvseg, o, lse)


def _attention_padded_bwd(st, res, do):
    q, k, v, qseg, kvseg, o, lse = res
    dq, dk, dv = _backward(st, q, k, v, qseg, kvseg, o, lse, do)
    return dq, dk, dv, None, None


_attention_padded.defvjp(_attention_padded_fwd, _attention_padded_bwd)


# ----------------------------------------------------------------------------- public entry point
def check_inputs(q, k, v, segment_ids, kv_segment_ids, window):
    """Shape validation shared by the kernels; returns kv segment ids (defaulting to q's)."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"expected q [B,T,H,D], k/v [B,S,K,D]; got {q.shape}, {k.shape}, "
                         f"{v.shape}")
    B, T, H, D = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k {k.shape} and v {v.shape} must have the same shape")
    if k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"k/v {k.shape} must match q {q.shape} in batch and head_dim")
    K = k.shape[2]
    if H % K:
        raise ValueError(f"query heads {H} must be a multiple of key/value heads {K}")
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if kv_segment_ids is None and segment_ids is not None:
        if k.shape[1] != T:
            raise ValueError("segment_ids given for q only but T != S; pass kv_segment_ids too")
        kv_segment_ids = segment_ids
    if (segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("pass segment ids for both queries and keys, or neither")
    if segment_ids is not None and (segment_ids.shape != (B, T) or
                                    kv_segment_ids.shape != (B, k.shape[1])):
        raise ValueError(f"segment ids must be [B, T] = {(B, T)} and [B, S] = {(B, k.shape[1])}, "
                         f"got {segment_ids.shape} and {kv_segment_ids.shape}")
    return kv_segment_ids


def pad_to(x, length: int, axis: int, value=0):
    extra = length - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def blockwise_attention(q, k, v, *, causal: bool = True, segment_ids=None, kv_segment_ids=None,
                        window: int | None = None, block_mask: BlockSparseMask | None = None,
                        q_offset: int = 0, scale: float | None = None,
                        block_q: int = 512, block_k: int = 512):
    """Tiled attention, q [B,T,H,D], k/v [B,S,K,D] -> [B,T,H,D], memory linear in T and S.

    Query t sits at position t + q_offset (keys at 0..S-1). Lengths that are not a multiple of the
    block are padded and the padded keys masked; block sizes larger than the sequence shrink to it.
    Rows with no allowed key return zeros.
    """
    kv_segment_ids = check_inputs(q, k, v, segment_ids, kv_segment_ids, window)
    B, T, H, D = q.shape
    S = k.shape[1]
    bq = min(block_q, -(-T // 8) * 8)
    bk = min(block_k, -(-S // 8) * 8)
    if block_mask is not None:  # tiles must divide the mask's blocks
        bq, bk = math.gcd(bq, block_mask.block_q), math.gcd(bk, block_mask.block_k)
    Tp, Sp = -(-T // bq) * bq, -(-S // bk) * bk
    st = _Static(T, S, bq, bk, bool(causal), window, int(q_offset),
                 float(D ** -0.5 if scale is None else scale), block_mask)
    qseg = None if segment_ids is None else pad_to(segment_ids.astype(jnp.int32), Tp, 1, -1)
    kvseg = None if kv_segment_ids is None else pad_to(kv_segment_ids.astype(jnp.int32), Sp, 1, -2)
    o = _attention_padded(st, pad_to(q, Tp, 1), pad_to(k, Sp, 1), pad_to(v, Sp, 1), qseg, kvseg)
    return o[:, :T]
